"""CLI: prints text, stats, and one-line errors with a non-zero exit."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from unmask.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def test_generate_prints_prompt_and_continuation(family_dirs):
    r = invoke("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "8", "--block-size", "4",
               "--stats", "hello world")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("hello world")
    assert "tokens/forward" in r.stderr and "forwards" in r.stderr
    assert "[policy threshold," in r.stderr  # SDAR names no default policy: the fallback


def test_generate_stats_name_the_models_default_policy(tmp_path):
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(Path(__file__).resolve().parents[1] / "bench/models/unmask-tiny-5m", model)
    gc = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gc, "default_policy": {"policy": "speculative"}}))
    r = invoke("generate", "--model", str(model), "--max-tokens", "8", "--stats", "def add(a, b):")
    assert r.exit_code == 0, r.output
    assert "[policy speculative," in r.stderr
    r = invoke("generate", "--model", str(model), "--max-tokens", "8", "--stats", "--threshold", "0.7", "def f():")
    assert "[policy threshold," in r.stderr  # another policy's knob: the threshold rule


def test_generate_is_deterministic_with_seed(family_dirs):
    args = ("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "8", "--temperature", "1.0",
            "--seed", "3", "hi")
    assert invoke(*args).stdout == invoke(*args).stdout


def test_generate_takes_penalties(family_dirs, monkeypatch, tmp_path):
    """The flags reach GenerationParams (the arithmetic is tested in test_logit_adjust.py)."""
    from unmask.engine import llm as llm_module

    seen = []
    original = llm_module.LLM.stream  # `unmask generate` streams its answer
    monkeypatch.setattr(llm_module.LLM, "stream", lambda self, ids, p: seen.append(p) or original(self, ids, p))
    r = invoke("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "8", "--block-size", "4",
               "--frequency-penalty", "0.5", "--presence-penalty", "1.5", "hi")
    assert r.exit_code == 0 and r.stdout.startswith("hi")
    assert (seen[0].frequency_penalty, seen[0].presence_penalty) == (0.5, 1.5)
    # a penalty in the model's generation_config is the default; a flag overrides it
    model = tmp_path / "sdar"
    shutil.copytree(family_dirs["sdar"], model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "frequency_penalty": 0.5,
                                                              "repetition_penalty": 1.3}))
    common = ("generate", "--model", str(model), "--max-tokens", "4", "--block-size", "4")
    assert invoke(*common, "hi").exit_code == 0
    assert (seen[1].frequency_penalty, seen[1].presence_penalty, seen[1].repetition_penalty) == (0.5, 0.0, 1.3)
    assert invoke(*common, "--frequency-penalty", "0", "--repetition-penalty", "1.1", "hi").exit_code == 0
    assert (seen[2].frequency_penalty, seen[2].repetition_penalty) == (0.0, 1.1)
    # chat_defaults apply to chat answers only (`unmask chat`, `generate --chat`), over the model-wide penalties
    (model / "generation_config.json").write_text(json.dumps({**gen, "repetition_penalty": 1.3,
                                                              "chat_defaults": {"frequency_penalty": 0.3}}))
    assert invoke(*common, "hi").exit_code == 0
    assert (seen[3].frequency_penalty, seen[3].repetition_penalty) == (0.0, 1.3)
    assert invoke(*common, "--chat", "hi").exit_code == 0
    assert (seen[4].frequency_penalty, seen[4].repetition_penalty) == (0.3, 1.3)
    assert invoke(*common, "--chat", "--frequency-penalty", "0", "hi").exit_code == 0
    assert seen[5].frequency_penalty == 0.0
    streamed = []
    monkeypatch.setattr(llm_module.LLM, "stream", lambda self, ids, p: streamed.append(p) or iter(()))
    r = runner.invoke(app, ["chat", "--model", str(model), "--max-tokens", "4"], input="hi\n/exit\n")
    assert r.exit_code == 0, r.output
    assert (streamed[0].frequency_penalty, streamed[0].repetition_penalty) == (0.3, 1.3)


def test_generate_takes_dry_flags(family_dirs, monkeypatch):
    from unmask.engine import llm as llm_module

    seen = []
    original = llm_module.LLM.stream  # `unmask generate` streams its answer
    monkeypatch.setattr(llm_module.LLM, "stream", lambda self, ids, p: seen.append(p) or original(self, ids, p))
    common = ("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "4", "--block-size", "4")
    assert invoke(*common, "--dry-multiplier", "0.8", "--dry-base", "2", "--dry-allowed-length", "3",
                  "--dry-sequence-breaker", "\\n", "--dry-sequence-breaker", ";", "hi").exit_code == 0
    assert (seen[0].dry_multiplier, seen[0].dry_base, seen[0].dry_allowed_length,
            seen[0].dry_sequence_breakers) == (0.8, 2.0, 3, ["\n", ";"])
    assert invoke(*common, "--dry-multiplier", "0.8", "--dry-sequence-breaker", "none", "hi").exit_code == 0
    assert seen[1].dry_sequence_breakers == [] and seen[1].dry_base == 1.75
    assert invoke(*common, "hi").exit_code == 0
    assert seen[2].dry_multiplier == 0.0 and seen[2].dry_sequence_breakers == ["\n", ":", "\"", "*"]


def test_generate_takes_sub_block_and_multi_block_flags(family_dirs, monkeypatch):
    from unmask.engine import llm as llm_module

    seen = []
    original = llm_module.LLM.stream  # `unmask generate` streams its answer
    monkeypatch.setattr(llm_module.LLM, "stream", lambda self, ids, p: seen.append(p) or original(self, ids, p))
    common = ("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "8", "--block-size", "4")
    assert invoke(*common, "--small-block-size", "2", "hi").exit_code == 0
    assert (seen[0].small_block_size, seen[0].multi_block_threshold) == (2, None)
    r = invoke(*common, "--small-block-size", "3", "hi")
    assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1].startswith("error: small_block_size")
    r = invoke(*common, "--multi-block-threshold", "0.5", "hi")  # SDAR has no causal context
    assert r.exit_code == 1 and "multi_block_threshold" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (("--model", "/no/such/dir"), "error: model directory '/no/such/dir' not found"),
    (("--policy", "bogus"), "error: name: unknown decoding policy 'bogus'"),
    (("--max-tokens", "0"), "error: max_tokens must be a positive integer"),
    (("--threshold", "1.5"), "error: threshold must be in (0, 1]"),
    (("--policy", "factor", "--factor", "0"), "error: factor must be > 0, got 0.0"),
    (("--policy", "credit", "--credit-decay", "2"), "error: credit_decay must be in [0, 1], got 2.0"),
    (("--alg-temp", "-1"), "error: alg_temp must be >= 0, got -1.0"),
    (("--policy", "entropy_bounded", "--entropy-bound", "-1"), "error: entropy_bound must be >= 0 (> 0 for DiffusionGemma), got -1.0"),
    (("--max-tokens", "5000"), "over this model's context of 4096"),
    (("--presence-penalty", "3"), "error: presence_penalty must be in [-2, 2], got 3.0"),
    (("--repetition-penalty", "0"), "error: repetition_penalty must be in (0, 10] (1 = off), got 0.0"),
    (("--dry-multiplier", "11"), "error: dry_multiplier must be in [0, 10] (0 = off), got 11.0"),
    (("--dry-allowed-length", "0"), "error: dry_allowed_length must be an integer in [1, 64], got 0"),
])
def test_bad_input_is_one_line(family_dirs, args, message):
    base = [] if "--model" in args else ["--model", str(family_dirs["sdar"])]
    r = invoke("generate", *base, *args, "hi")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_empty_prompt_is_one_line(family_dirs):
    r = invoke("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "4", "")
    assert r.exit_code == 1 and r.stderr.strip() == "error: the prompt is empty", r.stderr


def test_serve_refuses_a_port_out_of_range():
    r = invoke("serve", "--port", "70000")
    assert r.exit_code == 2 and "--port" in r.stderr and "65535" in r.stderr  # click's usage error, before any load


def test_chat_streams_replies_and_resets():
    """Two turns, a reset, a third turn; each reply printed after its prompt, stats on stderr."""
    r = runner.invoke(app, ["chat", "--max-tokens", "4", "--stats"], input="hi\nmore\n/reset\nagain\n/exit\nnot read\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("> ") == 5 and "(new conversation)" in r.stdout   # 4 inputs read, then /exit
    assert r.stderr.count("tokens/forward") == 3


def test_chat_history_reaches_the_template(monkeypatch):
    from unmask.engine import llm as llm_module

    seen = []
    original = llm_module.LLM.chat_prompt
    monkeypatch.setattr(llm_module.LLM, "chat_prompt", lambda self, m, tools=None: seen.append(
        [dict(x) for x in m]) or original(self, m, tools))
    r = runner.invoke(app, ["chat", "--max-tokens", "3", "--system", "be brief"], input="a\nb\n/reset\nc\n")
    assert r.exit_code == 0, r.output
    assert [[x["role"] for x in m] for m in seen] == [["system", "user"], ["system", "user", "assistant", "user"],
                                                     ["system", "user"]]
    assert seen[2][1]["content"] == "c"


def test_chat_caps_each_reply_to_the_context_left(monkeypatch):
    """`--max-tokens` over the context is cut to what the conversation leaves, as llama.cpp's server does, instead
    of failing every turn."""
    from unmask.engine import llm as llm_module

    budgets = []

    def stream(self, ids, params):
        budgets.append((len(ids), params.max_tokens, self.spec.max_context))
        return iter(())
    monkeypatch.setattr(llm_module.LLM, "stream", stream)
    r = runner.invoke(app, ["chat", "--max-tokens", "100000"], input="hi\nmore\n")
    assert r.exit_code == 0 and "error" not in r.stderr, r.output
    assert len(budgets) == 2 and all(n + limit == ctx for n, limit, ctx in budgets)
    r = runner.invoke(app, ["chat", "--max-tokens", "5"], input="hi\n")
    assert budgets[-1][1] == 5


def test_chat_needs_a_chat_template(family_dirs, tmp_path):
    import json

    src, d = family_dirs["sdar"], tmp_path / "plain"
    d.mkdir()
    for f in src.iterdir():
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("chat_template", None)
            (d / f.name).write_text(json.dumps(cfg))
        elif f.name != "chat_template.jinja":
            (d / f.name).symlink_to(f)
    r = runner.invoke(app, ["chat", "--model", str(d)], input="hi\n")
    assert r.exit_code == 1 and "has no chat template" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bench_reports_every_batch_size(family_dirs, tmp_path):
    import json

    out = tmp_path / "b.json"
    r = invoke("bench", "--model", str(family_dirs["sdar"]), "--batch", "1,3", "--prompt-len", "5",
               "--max-tokens", "6", "--rounds", "2", "--block-size", "4", "--json", str(out))
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert [(x["batch"], x["tokens"], x["rounds"]) for x in data["results"]] == [(1, 6, 2), (3, 18, 2)]
    for x in data["results"]:
        t = x["tokens_per_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"] and x["tokens_per_forward"]["median"] > 0
    assert "tokens/s" in r.stdout and len([ln for ln in r.stdout.splitlines() if ln.strip().startswith(("1 ", "3 "))]) == 2
    bad = invoke("bench", "--model", str(family_dirs["sdar"]), "--batch", "1,x")
    assert bad.exit_code == 1 and "--batch must be comma-separated integers" in bad.stderr


def test_llm_stream_equals_generate_and_aborts_when_closed(family_dirs):
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams

    llm = LLM(family_dirs["sdar"])
    params = GenerationParams(max_tokens=12, block_size=4, ignore_eos=True)
    whole = llm.generate("hello", params)[0]
    outs = list(llm.stream("hello", params))
    assert "".join(o.text_delta for o in outs) == whole.text and outs[-1].finished
    assert sum(len(o.new_token_ids) for o in outs) == 12
    gen = llm.stream("hello", params)
    next(gen)
    gen.close()
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("flag, expect", [((), None), (("--bf16",), True), (("--no-bf16",), False)])
def test_train_and_finetune_pass_the_bf16_choice(monkeypatch, tmp_path, flag, expect):
    """--bf16 / --no-bf16 reach TrainConfig; without either the trainer decides by the hardware (None)."""
    from unmask.train import trainer

    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg, *a, **k: seen.append(cfg) or _Done())
    monkeypatch.setattr(trainer, "finetune", lambda cfg, *a, **k: seen.append(cfg) or _Done())
    r = invoke("train", "--out", str(tmp_path / "a"), "--tokenizer", str(tmp_path), *flag)
    assert r.exit_code == 0, r.output
    r = invoke("finetune", "--model", str(tmp_path), "--data", str(tmp_path / "x.jsonl"), *flag)
    assert r.exit_code == 0, r.output
    assert [c.bf16 for c in seen] == [expect, expect]


def test_eval_batches_reach_every_training_command(monkeypatch, tmp_path):
    """--eval-batches sets how many held-out batches an evaluation reads (default 8) in train, finetune and
    distill; zero is a one-line error before anything runs."""
    from unmask.train import distill, trainer

    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg, *a, **k: seen.append(cfg) or _Done())
    monkeypatch.setattr(trainer, "finetune", lambda cfg, *a, **k: seen.append(cfg) or _Done())
    monkeypatch.setattr(distill, "distill", lambda cfg, *a, **k: seen.append(cfg) or _Done())
    base = {"train": ("train", "--out", str(tmp_path / "a"), "--tokenizer", str(tmp_path)),
            "finetune": ("finetune", "--model", str(tmp_path), "--data", str(tmp_path / "x.jsonl")),
            "distill": ("distill", "--model", str(tmp_path), "--text", str(tmp_path), "--out", str(tmp_path / "d"))}
    for args in base.values():
        assert invoke(*args).exit_code == 0
        r = invoke(*args, "--eval-batches", "2")
        assert r.exit_code == 0, r.output
    assert [c.eval_batches for c in seen] == [8, 2] * 3
    for args in base.values():
        r = invoke(*args, "--eval-batches", "0")
        assert r.exit_code == 1 and r.output.strip() == "error: eval_batches must be positive, got 0"
    assert len(seen) == 6


class _Done:
    steps, model_dir = 0, "nowhere"


def test_eval_samples_the_completion_tasks_reproducibly(family_dirs, tmp_path, monkeypatch):
    """`unmask eval --temperature T --seed S`: every completion request samples with them, the same seed gives
    the same scores, and the JSON records the settings; out-of-range values are one-line errors."""
    from unmask.engine import llm as llm_module
    from unmask.train.corpus import CorpusFile, write_documents

    seen = []
    original = llm_module.LLM.generate
    monkeypatch.setattr(llm_module.LLM, "generate", lambda self, ids, p: seen.extend(p) or original(self, ids, p))

    code = "\n".join(["import os", "", "", "def f(x):", "    y = x + 1", "    return y * 2", ""] * 30)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_documents([CorpusFile("stdlib", f"m{i}.py", code) for i in range(3)], corpus / "heldout.jsonl")
    args = ("eval", "-m", str(family_dirs["sdar"]), "--corpus", str(corpus), "--sft-heldout", "none",
            "--limit", "3", "--policies", "threshold_0.9", "--chat-limit", "0", "--temperature", "1.0", "--seed", "5")
    runs = []
    for i in range(2):
        r = invoke(*args, "--json", str(tmp_path / f"{i}.json"))
        assert r.exit_code == 0, r.output
        runs.append(json.loads((tmp_path / f"{i}.json").read_text()))
    assert runs[0]["sampling"] == {"temperature": 1.0, "top_p": 1.0, "seed": 5}
    assert seen and all((p.temperature, p.seed) == (1.0, 5) for p in seen)
    scores = [[(t["task"], t["accuracy"], t["edit_similarity"], t["tokens"]) for t in run["tasks"]] for run in runs]
    assert scores[0] == scores[1] and {s[0] for s in scores[0]} == {"next_line", "function"}
    r = invoke(*args[:-4], "--temperature", "3")
    assert r.exit_code == 1 and r.stderr.strip().splitlines() == [
        "error: --temperature must be in [0, 2] and --top-p in (0, 1], got 3.0 and 1.0"]


def _damaged_copy(src: Path, dst: Path, damage) -> Path:
    shutil.copytree(src, dst)
    damage(dst)
    return dst


def _edit_config(**changes):
    def damage(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return damage


def _int_norms(d: Path):
    from safetensors.torch import load_file, save_file
    f = next(d.glob("*.safetensors"))
    state = load_file(f)
    state = {k: (v.to(torch.int32) if "norm" in k else v) for k, v in state.items()}
    save_file(state, f, metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json must hold a JSON object, not list"),
    (_edit_config(hidden_size="256"), "hidden_size must be a positive integer, got '256'"),
    (_edit_config(num_attention_heads=-8), "num_heads must be a positive integer, got -8"),
    (_int_norms, "is int32, not a floating-point tensor"),
    (lambda d: (d / "tokenizer_config.json").write_text("{broken"), "tokenizer_config.json is not valid JSON"),
])
def test_a_damaged_model_directory_is_one_line(family_dirs, tmp_path, damage, message):
    broken = _damaged_copy(family_dirs["sdar"], tmp_path / "broken", damage)
    r = invoke("generate", "--model", str(broken), "--max-tokens", "2", "hi")
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


@pytest.mark.parametrize("args, message", [
    (("--device", "bogus"), "error: unknown device 'bogus'; use auto, cpu or cuda[:N]"),
    (("--device", "mps"), "error: device 'mps' is not supported; use auto, cpu or cuda[:N]"),
    (("--seed", str(10**20)), "error: seed must be an integer in [-2**63, 2**64)"),
])
def test_device_and_seed_errors_are_one_line(family_dirs, args, message):
    r = invoke("generate", "--model", str(family_dirs["sdar"]), *args, "hi")
    assert r.exit_code == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr, r.stderr


def test_device_auto_takes_the_environment_then_what_is_available(monkeypatch):
    from unmask.models.loader import resolve_device

    monkeypatch.delenv("UNMASK_DEVICE", raising=False)
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == resolve_device(None) == want
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"  # explicit wins
    monkeypatch.setenv("UNMASK_DEVICE", "cpu")
    assert resolve_device("auto") == "cpu"
    r = invoke("generate", "--device", "auto", "--max-tokens", "3", "def f(x):")
    assert r.exit_code == 0 and r.stdout.startswith("def f(x):"), r.output


def test_a_prompt_that_is_not_utf8_is_one_line(family_dirs):
    r = invoke("generate", "--model", str(family_dirs["sdar"]), "\udcff\udcfe")   # how bytes \xff\xfe arrive
    assert r.exit_code == 1 and r.stderr.strip() == "error: the prompt is not valid UTF-8", r.stderr


@pytest.mark.parametrize("args, message", [
    (("--log-level", "bogus"), "error: --log-level must be one of critical, error, warning, info, debug, trace"),
    (("--dtype", "bogus"), "error: unknown dtype 'bogus'"),
])
def test_serve_flag_errors_before_binding(family_dirs, args, message):
    r = invoke("serve", "--model", str(family_dirs["sdar"]), "--port", "1", *args)
    assert r.exit_code == 1 and message in r.stderr, r.stderr


def test_serve_refuses_a_directory_that_is_no_model_before_binding(family_dirs, tmp_path):
    run = tmp_path / "run"  # a training run's directory: the export is run/model
    shutil.copytree(family_dirs["sdar"], run / "model")
    r = invoke("serve", "--model", str(run), "--port", "1")
    assert r.exit_code == 1 and r.stderr.strip() == (f"error: {run} has no config.json (a training run's export is "
                                                     f"its model/ folder: {run / 'model'})"), r.stderr
    r = invoke("serve", "--model", str(family_dirs["sdar"]), "--port", "1", "--device", "mps")
    assert r.exit_code == 1 and "device 'mps' is not supported" in r.stderr and "Uvicorn" not in r.output, r.output


def test_serve_refuses_a_chat_template_that_does_not_parse(family_dirs, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }")
    r = invoke("serve", "--model", str(family_dirs["sdar"]), "--port", "1", "--chat-template", str(template))
    assert r.exit_code == 1 and r.stderr.startswith(f"error: the chat template {template} does not parse"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_eval_checks_its_outputs_and_named_inputs_up_front(family_dirs, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "heldout.jsonl").write_text(json.dumps({"source": "stdlib", "path": "a.py", "text": "x = 1\n"}) + "\n")
    base = ["eval", "--model", str(family_dirs["sdar"]), "--corpus", str(corpus)]
    r = invoke(*base, "--json", str(tmp_path / "missing" / "out.json"))
    assert r.exit_code == 1 and "--json" in r.stderr and "cannot be written" in r.stderr, r.stderr
    r = invoke(*base, "--json", str(tmp_path))
    assert r.exit_code == 1 and "cannot be written" in r.stderr
    r = invoke(*base, "--sft-heldout", str(tmp_path / "nope.jsonl"))
    assert r.exit_code == 1 and r.stderr.strip() == f"error: --sft-heldout {tmp_path / 'nope.jsonl'} not found"


def test_served_name_of_a_training_runs_model_folder_is_the_runs_name(tmp_path):
    from unmask.server.cli import default_served_name

    (tmp_path / "runs" / "sft" / "model").mkdir(parents=True)
    (tmp_path / "my-model").mkdir()
    assert default_served_name(tmp_path / "runs" / "sft" / "model") == "sft"
    assert default_served_name(tmp_path / "runs" / "sft" / "model" / "..") == "sft"
    assert default_served_name(tmp_path / "my-model") == "my-model"


def test_generate_streams_the_same_text_the_engine_generates(monkeypatch):
    """The answer is written delta by delta as blocks commit; what arrives is the prompt plus the answer that
    LLM.generate returns for the same request, with one newline at the end."""
    from unmask.engine import llm as llm_module
    from unmask.engine.params import GenerationParams

    writes = []
    original = llm_module.LLM.stream
    monkeypatch.setattr(llm_module.LLM, "stream",
                        lambda self, ids, p: (writes.append(out.text_delta) or out for out in original(self, ids, p)))
    r = invoke("generate", "--max-tokens", "24", "def add(a, b):")  # the built-in model: real text
    assert r.exit_code == 0
    want = llm_module.LLM().generate("def add(a, b):", GenerationParams(max_tokens=24))[0]
    assert want.text and r.stdout == "def add(a, b):" + want.text + "\n" and "".join(writes) == want.text
    assert len([w for w in writes if w]) >= 2  # more than one piece: it streamed
