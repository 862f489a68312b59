"""Distillation for parallel decoding: certainty forcing, trajectory rows, the cache, resume, CLI errors."""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from test_train import CHAT, FIM, SDAR_CFG, _cli, _one_line_error, _tiny_family_checkpoint, join_ddp, logits_all, \
    spawn_ddp, tiny_cfg, tiny_model, tokdir, write_corpus  # noqa: F401 (tokdir: a fixture)
from unmask.models.loader import load_model
from unmask.train.data import DataError
from unmask.train.distill import distill, trajectory_rows
from unmask.train.objectives import Noise, Objective, certainty_sum, diffusion_loss_sum
from unmask.train.trainer import TrainConfigError, train
from unmask.train.trajectories import Trajectory, TrajectoryConfig

TEXT = "def add(a, b):\n    return a + b\n\nthe cat sat on the mat.\nthe dog ate the bone.\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Documents with line ends (text prompts are cut before one)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"), TEXT * 4, n=6)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokdir, corpus) -> Path:
    """A tiny unmask model (shifted block diffusion is what `train` makes by default) to distil."""
    res = train(tiny_cfg(tmp_path_factory.mktemp("base") / "run", total_steps=2, seq_len=64), corpus, tokdir)
    return res.model_dir


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    p.write_text((json.dumps(CHAT) + "\n" + json.dumps(FIM) + "\n") * 4)
    return p


TRAJ = TrajectoryConfig(prompts=12, chat_fraction=0.25, context_chars=40, min_context_chars=8, max_tokens=8,
                        shard_size=5)


def _cfg(out: Path, **kw):
    return tiny_cfg(out, **{"total_steps": 3, "seq_len": 64, "block_sizes": None, "confidence_weight": 2.0, **kw})


_base_cfg = _cfg


# ------------------------------------------------------------------ the objective

def test_certainty_sum_is_the_entropy_of_right_rows_only():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 1.0], [1.0, 1.0, 4.0]])
    target = torch.tensor([0, 2, 2])  # rows 0 and 2 right, row 1 wrong
    p0 = torch.softmax(logits[0], 0)
    p2 = torch.softmax(logits[2], 0)
    expected = float(-(p0 * p0.log()).sum() - (p2 * p2.log()).sum())
    assert float(certainty_sum(logits, target)) == pytest.approx(expected, rel=1e-6)
    assert float(certainty_sum(logits, torch.tensor([1, 0, 0]))) == 0.0  # nothing right: nothing forced


def test_confidence_weight_adds_the_weighted_entropy_of_right_masked_predictions():
    torch.manual_seed(0)
    model = tiny_model()
    x0 = torch.randint(16, 60, (2, 12))
    masked = torch.zeros(2, 12, dtype=torch.bool)
    masked[:, 3:9] = True
    xt = torch.where(masked, torch.full_like(x0, 63), x0)
    logits = logits_all(model, xt)
    x0[:, 3:6] = logits[:, 3:6].argmax(-1)  # half the masked targets are what the model predicts
    p = torch.full((2, 12), 0.5)
    noise = Noise(None, masked, p)
    plain = Objective(mask_id=63)
    forced = Objective(mask_id=63, confidence_weight=1.5)
    with torch.no_grad():
        base_loss = float(diffusion_loss_sum(model, x0, noise, plain))
        with_cf = float(diffusion_loss_sum(model, x0, noise, forced))
    rows = logits[masked]
    right = rows.argmax(-1) == x0[masked]
    assert int(right.sum()) >= 6
    logp = F.log_softmax(rows[right], -1)
    entropy = float(-(logp.exp() * logp).sum())
    ce = float((F.cross_entropy(rows, x0[masked], reduction="none") / 0.5).sum())
    assert base_loss == pytest.approx(ce, rel=1e-5)
    assert with_cf - base_loss == pytest.approx(1.5 * entropy, rel=1e-4)


def test_confidence_weight_is_checked():
    with pytest.raises(ValueError, match="confidence_weight must be >= 0"):
        Objective(mask_id=3, confidence_weight=-1.0)
    with pytest.raises(TrainConfigError, match="confidence_weight must be a finite number >= 0"):
        tiny_cfg(Path("/tmp/x"), confidence_weight=float("nan"))
    with pytest.raises(TrainConfigError, match="objective 'causal' masks nothing"):
        tiny_cfg(Path("/tmp/x"), confidence_weight=1.0, objective="causal")


# ------------------------------------------------------------------ rows

def test_trajectory_rows_put_the_prompt_at_zero_and_the_loss_on_the_answer():
    trajs = [Trajectory([5, 6, 7], [8, 9, 2], "text", "stop", 3),
             Trajectory([5, 6], [8, 9, 10, 11], "chat", "length", 4)]
    rows = trajectory_rows(trajs, 8, pad_id=2)
    assert rows.ids.tolist() == [[5, 6, 7, 8, 9, 2, 2, 2], [5, 6, 8, 9, 10, 11, 2, 2]]
    # a stopped answer's padding is in the loss (nothing follows it); a cut one's is not
    assert rows.loss_mask.tolist() == [[False, False, False, True, True, True, True, True],
                                       [False, False, True, True, True, True, False, False]]
    with pytest.raises(DataError, match="no trajectory has an answer token"):
        trajectory_rows([Trajectory([5] * 8, [6], "text", "length", 1)], 8, pad_id=2)


# ------------------------------------------------------------------ end to end

def test_distill_caches_trajectories_counts_compute_and_exports_a_loadable_model(tmp_path, base, corpus, chat_file):
    res = distill(_cfg(tmp_path / "run"), base, TRAJ, text=corpus, chat=chat_file)
    shards = sorted((tmp_path / "run" / "trajectories").glob("shard-*.jsonl"))
    assert [s.name for s in shards] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    trajs = [json.loads(line) for s in shards for line in s.read_text().splitlines()[:-1]]
    assert len(trajs) == 12 and sum(t["kind"] == "chat" for t in trajs) == 3
    assert all(1 <= len(t["answer"]) <= 8 + 1 and t["prompt"] for t in trajs)
    # one token per forward: each answer token was committed by a forward of its own, in the recorded order
    assert all(len(t["order"]) == len(t["answer"]) and len(set(t["order"])) == len(t["order"])
               and min(t["order"]) >= 1 and max(t["order"]) <= t["forwards"] for t in trajs)
    report = json.loads((tmp_path / "run" / "distill.json").read_text())
    assert report["teacher"]["requests"] == 12
    assert report["teacher"]["answer_tokens"] == sum(len(t["answer"]) - (t["finish"] == "stop") for t in trajs)
    assert report["teacher"]["forwards"] == sum(t["forwards"] for t in trajs)
    assert report["student"]["trained_positions"] == 3 * 4 * 64 * 2  # steps x rows x seq_len x two streams
    n = report["parameters"]
    assert report["student"]["flops"] == 6 * n * report["student"]["trained_positions"]
    assert report["total_flops"] == report["teacher"]["flops"] + report["student"]["flops"]
    assert report["teacher"]["parameters"] == n  # self-distillation: the teacher is the model
    assert report["teacher"]["flops"] == 2 * n * report["teacher"]["tokens_fed"]
    # the distilled checkpoint loads where the base did, in its format, with the weights the run trained
    loaded, spec = load_model(res.model_dir, dtype="float32")
    assert spec.family.name == "unmask"
    ids = torch.randint(16, 60, (2, 16))
    assert torch.allclose(logits_all(res.model, ids), logits_all(loaded, ids), atol=1e-5)


class Killed(Exception):
    pass


def distill_killed_at_2(cfg, model: Path, corpus: Path) -> None:
    """A distillation killed after its second step (its checkpoint saved there when cfg.save_every is 2)."""
    def kill_at_2(step, _metrics):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        distill(cfg, model, TRAJ, text=corpus, on_step=kill_at_2)


@pytest.mark.parametrize("draft_adapter_rank", [0, 4])  # 4: only a draft adapter trains (models/draft_adapter.py)
def test_resume_reuses_the_cache_and_continues_exactly(tmp_path, base, corpus, monkeypatch, draft_adapter_rank):
    import unmask.train.distill as distill_mod

    _cfg = functools.partial(_base_cfg, draft_adapter_rank=draft_adapter_rank)
    full = distill(_cfg(tmp_path / "full", total_steps=4), base, TRAJ, text=corpus)

    distill_killed_at_2(_cfg(tmp_path / "cut", total_steps=4, save_every=2), base, corpus)
    before = {p.name: p.read_bytes() for p in (tmp_path / "cut" / "trajectories").iterdir()}

    def no_teacher(*_a, **_k):
        raise AssertionError("a resumed run must not regenerate cached trajectories")

    monkeypatch.setattr(distill_mod, "_teacher_engine", no_teacher)
    resumed = distill(_cfg(tmp_path / "cut", total_steps=4, save_every=2, resume=True), base, TRAJ, text=corpus)
    assert resumed.losses == pytest.approx(full.losses, abs=1e-6)
    assert {p.name: p.read_bytes() for p in (tmp_path / "cut" / "trajectories").iterdir()} == before


def test_a_cache_from_another_teacher_or_recipe_is_refused(tmp_path, base, corpus, tokdir):
    out = tmp_path / "run"
    distill(_cfg(out, total_steps=1), base, TRAJ, text=corpus)
    other = train(tiny_cfg(tmp_path / "other", total_steps=2, seq_len=64, seed=1), corpus, tokdir).model_dir
    with pytest.raises(DataError, match="trajectories were made with another teacher weights"):
        distill(_cfg(out, total_steps=2, resume=True), other, TRAJ, text=corpus)
    changed = TrajectoryConfig(**{**TRAJ.__dict__, "max_tokens": 6})
    with pytest.raises(DataError, match="trajectories were made with another recipe"):
        distill(_cfg(out, total_steps=2, resume=True), base, changed, text=corpus)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, base, corpus):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    for f in base.iterdir():
        (teacher / f.name).write_bytes(f.read_bytes())
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, other numbering
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DataError, match="numbers tokens differently"):
        distill(_cfg(tmp_path / "run"), base, TRAJ, text=corpus, teacher_dir=teacher)


@pytest.mark.parametrize("lora", [0, 4])
def test_public_block_causal_family_distils_full_or_lora(tmp_path, tokdir, chat_file, lora):
    src = tmp_path / "sdar"
    before = _tiny_family_checkpoint(src, SDAR_CFG, tokdir)
    traj = TrajectoryConfig(prompts=6, max_tokens=8, shard_size=6)
    res = distill(_cfg(tmp_path / "run", seq_len=96, lora_rank=lora, lr=5e-2, confidence_weight=1.0), src, traj,
                  chat=chat_file)
    loaded, spec = load_model(res.model_dir, dtype="float32")
    assert spec.family.name == "sdar"
    ids = torch.randint(16, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    # LoRA: the export merges W + B A alpha / r, whose float32 rounding differs from the unmerged sum by ~1e-5
    # after a run at this lr; a wrong merge would differ by the whole delta
    assert torch.allclose(logits_all(res.model, ids), logits_all(loaded, ids), atol=1e-4 if lora else 1e-5)
    key = "model.layers.0.self_attn.q_proj.weight"
    from safetensors import safe_open
    with safe_open(str(res.model_dir / "model.safetensors"), "pt") as fh:
        assert not torch.equal(fh.get_tensor(key), before[key])
    if lora:
        assert (res.out_dir / "adapter" / "adapter_model.safetensors").is_file()


# ------------------------------------------------------------------ command line

def test_cli_distill_errors_are_one_line(tmp_path, base, corpus):
    _one_line_error(_cli("distill", "--model", base, "--out", tmp_path / "a"), "--text, --chat or both")
    _one_line_error(_cli("distill", "--model", base, "--text", corpus, "--out", tmp_path / "b",
                         "--teacher-policy", "nope"), "unknown decoding policy")
    _one_line_error(_cli("distill", "--model", base, "--text", tmp_path / "missing", "--out", tmp_path / "c"),
                    "missing: no corpus")
    _one_line_error(_cli("distill", "--model", base, "--text", corpus, "--out", tmp_path / "d", "--seq-len", 32,
                         "--answer-tokens", 64), "no room for a prompt")


def test_cli_distill_runs(tmp_path, base, corpus):
    r = _cli("distill", "--model", base, "--text", corpus, "--out", tmp_path / "run", "--prompts", 6,
             "--answer-tokens", 6, "--steps", 2, "--batch-size", 4, "--seq-len", 48, "--warmup", 0,
             "--eval-every", 0, "--no-bf16")
    assert r.exit_code == 0, r.output
    assert "final model in" in r.output and (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert math.isfinite(json.loads((tmp_path / "run" / "distill.json").read_text())["total_flops"])


def _ddp_distill_worker(rank: int, world: int, port: int, out: str, base: str, corpus: str) -> None:
    join_ddp(rank, world, port)
    res = distill(_cfg(Path(out), total_steps=2), base, TRAJ, text=corpus)
    Path(out, f"losses{rank}.json").write_text(json.dumps(res.losses))


def test_ddp_two_processes_share_the_shards_and_match_one(tmp_path, base, corpus):
    single = distill(_cfg(tmp_path / "one", total_steps=2), base, TRAJ, text=corpus)
    out = tmp_path / "ddp"
    for losses in spawn_ddp(_ddp_distill_worker, out, str(base), str(corpus)):
        assert losses == pytest.approx(single.losses, abs=1e-6)
    # the shards two ranks generated (rank i mod 2) hold what one process generated
    for name in ("shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"):
        one = [json.loads(x) for x in (tmp_path / "one" / "trajectories" / name).read_text().splitlines()[:-1]]
        two = [json.loads(x) for x in (out / "trajectories" / name).read_text().splitlines()[:-1]]
        assert [(t["prompt"], t["answer"]) for t in one] == [(t["prompt"], t["answer"]) for t in two]
