"""Issue 31's prepared check: the block-causal fast path at a real model size, beside transformers.

    PYTHONUNBUFFERED=1 python3 scripts/device_check.py --part block --out $OUT          # a lent GPU, < 6 min
    python scripts/device_check.py --part block --tiny --device cpu --out /tmp/blk       # the same code, tiny

1. A checkpoint in SDAR's on-disk format (tests/tiny_checkpoints.make_sdar) at the Qwen3-1.7B shape: hidden
   2048, 28 layers, 16 query / 8 KV heads of 128, FFN 6144, vocabulary 151,936, tied embeddings, bf16, random
   weights, blocks of 16. `--tiny`: hidden 64, 2 layers, the same vocabulary.
2. Identity: the static step (engine/static_step.py; CUDA graphs on a GPU) against the eager step on the same
   greedy requests, tokens compared per request.
3. Speed: unmask with the static step and eagerly, at batch 1, 4, 16, 64: a fixed 1, 2, 4 and 8 tokens per
   forward (policy topk, EOS ignored), threshold 0.9, and threshold 0.9 sampled at temperature 0.8 / top-p 0.95
   (the static step drawing on the device, the eager step on the host); random-token prompts of --prompt-len,
   --max-tokens each; a warm-up run of each static configuration first (it captures the graphs), then the timed one. Tokens/s,
   ms per forward (wall time / engine steps, prefill included), tokens per forward. The eager engine warms up
   once per batch size only: its runs are the slow ones, and it has no graphs to capture.
4. Host synchronisations per step: the torch profiler's cudaStreamSynchronize / cudaDeviceSynchronize /
   cudaEventSynchronize / device-to-host cudaMemcpy events on CUDA, and everywhere the tensor calls that read a
   device tensor back (static_step.HostReads), for one static and one eager run at batch 1.
5. transformers' Qwen3ForCausalLM with the same weights: `generate` (greedy, EOS ignored) with its dynamic cache
   at each batch, and with a static cache + torch.compile (transformers' CompileConfig, mode reduce-overhead)
   at batch 1 (skipped with --tiny or when the time budget is spent; compile time reported apart).

6. LLaDA2.0-mini's MoE shape (scripts/device_check_moe.py), in the --moe-reserve-s seconds the dense shape's
   sections leave free (and whatever else the budget leaves), or alone with `--shapes llada2-mini` (the dense
   shape alone: `--shapes qwen3-1.7b`).

Writes block_check.json (after every part) and block_check.md (the table for docs/benchmarks.md). Sections
that would overrun --budget-s are skipped and marked so, so that the one call ends inside its limit.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from device_check_gemma import log, sync  # the same console lines and device waits as the other checks

QWEN3_1P7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=6144, max_position_embeddings=40960, tie_word_embeddings=True, block_size=16)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, max_position_embeddings=4096, tie_word_embeddings=True, block_size=16)
MODES = {"topk1": dict(policy="topk", tokens_per_step=1), "topk2": dict(policy="topk", tokens_per_step=2),
         "topk4": dict(policy="topk", tokens_per_step=4), "topk8": dict(policy="topk", tokens_per_step=8),
         "threshold0.9": dict(policy="threshold", threshold=0.9),
         # sampled (temperature 0.8, top-p 0.95): the static step draws on the device, the eager step on the host
         "sample0.8": dict(policy="threshold", threshold=0.9, temperature=0.8, top_p=0.95, seed=0)}
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
START = time.monotonic()


def build_checkpoint(out: Path, tiny: bool) -> Path:
    from tiny_checkpoints import make_sdar

    shape = TINY if tiny else QWEN3_1P7B
    return make_sdar(out, dtype="bfloat16", **shape)


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, min(vocab, 150000), (batch, length), generator=g).tolist()


def run_engine(eng, batch_prompts: list[list[int]], params, device: str) -> dict:
    steps0 = eng.stats.steps
    sync(device)
    t0 = time.perf_counter()
    seqs = [eng.add_request(p, params) for p in batch_prompts]
    eng.run_to_completion()
    sync(device)
    seconds = time.perf_counter() - t0
    steps = eng.stats.steps - steps0
    tokens = sum(len(s.output_ids) for s in seqs)
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "tokens_per_s": tokens / seconds,
            "ms_per_forward": 1000 * seconds / max(steps, 1),
            "tokens_per_forward": tokens / max(steps, 1) / len(batch_prompts),  # per request
            "outputs": [s.output_ids for s in seqs]}


def new_engine(model, spec, static: bool, batches: list[int], prompt_len: int, max_tokens: int):
    from unmask.engine.engine import Engine
    from unmask.engine.static_step import MAX_WIDTH

    per_request = -(-(prompt_len + max_tokens) // 16) * 16 + MAX_WIDTH + 16
    eng = Engine(model, spec, None, max_num_seqs=max(batches), max_batch_tokens=max(4096, prompt_len * max(batches)),
                 static_step=static, kv_pool_tokens=per_request * max(batches))
    if static:  # sampled requests draw inside the step (its default where it is captured; here off the GPU too)
        eng.runner.static.sample = True
    return eng


def unmask_speed(model, spec, args, report: dict, out: Path, key: str = "unmask", modes: tuple[str, ...] = tuple(MODES),
                 eager_runs: list[tuple[int, str]] | None = None) -> None:
    """Rows into report[key]; the static step at every batch and mode, eagerly likewise or only `eager_runs`
    ((batch, mode) pairs: the MoE shape's eager step is too slow for all), and (on CUDA) the static step
    without capture at the smallest and largest batch with 4 tokens per forward."""
    from unmask.engine.params import GenerationParams

    rows = report.setdefault(key, [])
    outputs = report.setdefault(f"_{key}_outputs", {})

    def variant(static: bool, graphs: bool) -> None:
        eng = new_engine(model, spec, static, args.batches, args.prompt_len, args.max_tokens)
        if static and not graphs:
            eng.runner.static.graphs = False
        runs = [(b, m) for b in args.batches for m in modes]
        if static and not graphs:
            runs = [(b, "topk4") for b in dict.fromkeys([args.batches[0], args.batches[-1]])]
        elif not static and eager_runs is not None:
            runs = eager_runs
        warmed = set()
        for batch, name in runs:
            knobs = MODES[name]
            if over_budget(args, 25):
                rows.append({"static": static, "graphs": graphs, "batch": batch, "mode": name,
                             "skipped": "time budget"})
                continue
            params = GenerationParams(max_tokens=args.max_tokens, ignore_eos=True, **{"temperature": 0.0, **knobs})
            batch_prompts = prompts(batch, args.prompt_len, spec.arch.vocab_size, seed=batch)
            if static or batch not in warmed:  # warm-up: captures the shapes' graphs (eager: once per batch)
                run_engine(eng, batch_prompts, params, args.device)
                warmed.add(batch)
            r = run_engine(eng, batch_prompts, params, args.device)
            got = r.pop("outputs")
            st = eng.runner.static
            row = {"static": static, "graphs": bool(st and st.graphs), "batch": batch, "mode": name, **r,
                   "captures": st.captures if st else 0, "replays": st.replays if st else 0}
            rows.append(row)
            if (graphs or not static) and "temperature" not in knobs:  # sampled: other draws, not comparable
                outputs[f"{static}-{batch}-{name}"] = got
            log(f"{key} static={static} graphs={graphs} batch={batch} {name}: {r['tokens_per_s']:,.0f} tokens/s, "
                f"{r['ms_per_forward']:.2f} ms/forward, {r['tokens_per_forward']:.2f} tokens/forward")

    # the static step with graphs, eagerly, and (on CUDA, two rows) on its buffers without capture: what the
    # graphs alone buy
    uncaptured = args.device.startswith("cuda")
    for static, graphs in ((True, True), (False, False)) + (((True, False),) if uncaptured else ()):
        guarded(f"{key} static={static} graphs={graphs}", report, variant, static, graphs)
        save(report, out)

    same = total = 0
    for run, o in outputs.items():
        if run.startswith("True-") and "False-" + run[5:] in outputs:
            other = outputs["False-" + run[5:]]
            same += sum(a == b for a, b in zip(o, other))
            total += len(o)
    report["identity" if key == "unmask" else f"{key}_identity"] = {
        "identical_requests": same, "of": total,
        "note": "static step vs eager, greedy, same prompts (bf16: rounding may differ)"}
    log(f"{key} identity: {same}/{total} requests token-identical")


def host_syncs(model, spec, args, report: dict, key: str = "host_syncs") -> None:
    """Host reads per step (any device) and, on CUDA, the profiler's synchronising calls per step."""
    from unmask.engine.params import GenerationParams
    from unmask.engine.static_step import HostReads

    params = GenerationParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, policy="topk",
                              tokens_per_step=4)
    out = {}
    for static in (True, False):
        eng = new_engine(model, spec, static, [1], args.prompt_len, args.max_tokens)
        p = prompts(1, args.prompt_len, spec.arch.vocab_size, seed=7)
        run_engine(eng, p, params, args.device)  # warm-up
        reads = []
        real = eng.runner.execute

        def execute(plans, real=real):
            with HostReads() as h:
                result = real(plans)
            reads.append(h.count)
            return result

        eng.runner.execute = execute
        row = {}
        if args.device.startswith("cuda"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                r = run_engine(eng, p, params, args.device)
            events = [e for e in prof.events() if any(s in e.name for s in SYNC_EVENTS)
                      or ("cudaMemcpy" in e.name and "Async" not in e.name)]
            row["cuda_sync_calls_per_step"] = len(events) / max(r["steps"], 1)
            row["cuda_sync_names"] = sorted({e.name for e in events})
        else:
            r = run_engine(eng, p, params, args.device)
        row["host_reads_per_step"] = statistics.mean(reads) if reads else None
        row["steps"] = r["steps"]
        out["static" if static else "eager"] = row
        log(f"host syncs static={static}: {row}")
    report[key] = out


def host_time(model, spec, args, report: dict, key: str = "host_time") -> None:
    """Where a static step's wall time goes, per engine step, at the smallest and largest batch (topk 4): the
    host's planning (Scheduler.schedule), staging (StaticStep._stage: the rows the step did not advance
    itself), its wait in the step's one read (on a GPU: for the device), reading the proposals out (the rest of
    _outputs), committing (Sequence.apply), and the rest (the launch or, off the GPU, the forward itself; the
    engine's own loop). perf_counter around each; `staged`: the share of the requests' rows the host staged."""
    from unmask.engine.params import GenerationParams
    from unmask.engine.scheduler import Scheduler
    from unmask.engine.sequence import Sequence
    from unmask.engine.static_step import StaticStep

    params = GenerationParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, **MODES["topk4"])
    parts = {"plan": (Scheduler, "schedule"), "stage": (StaticStep, "_stage"), "read": (StaticStep, "_outputs"),
             "commit": (Sequence, "apply")}
    rows = report.setdefault(key, [])
    for batch in dict.fromkeys([args.batches[0], args.batches[-1]]):
        eng = new_engine(model, spec, True, [batch], args.prompt_len, args.max_tokens)
        batch_prompts = prompts(batch, args.prompt_len, spec.arch.vocab_size, seed=11)
        run_engine(eng, batch_prompts, params, args.device)  # warm-up: captures
        spent = dict.fromkeys(parts, 0.0)
        saved = {name: getattr(cls, attr) for name, (cls, attr) in parts.items()}

        def timed(name, real):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return real(*a, **kw)
                finally:
                    spent[name] += time.perf_counter() - t0
            return wrapper

        try:
            for name, (cls, attr) in parts.items():
                setattr(cls, attr, timed(name, saved[name]))
            wait0 = eng.runner.static.wait_s
            res = eng.runner.static.resident
            staged0 = (res.staged, res.resident)
            r = run_engine(eng, batch_prompts, params, args.device)
        finally:
            for name, (cls, attr) in parts.items():
                setattr(cls, attr, saved[name])
        steps = max(r["steps"], 1)
        wait = eng.runner.static.wait_s - wait0
        ms = {"plan": spent["plan"], "stage": spent["stage"], "wait": wait, "read": spent["read"] - wait,
              "commit": spent["commit"]}
        ms = {k: 1000 * v / steps for k, v in ms.items()}
        ms["rest"] = 1000 * r["seconds"] / steps - sum(ms.values())
        staged, resident = res.staged - staged0[0], res.resident - staged0[1]
        rows.append({"batch": batch, "steps": r["steps"], "ms_per_step": 1000 * r["seconds"] / steps, **ms,
                     "staged": staged / max(staged + resident, 1)})
        log(f"{key} batch={batch}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[-1].items() if k != "batch"))


def hf_speed(path: Path, args, report: dict, out: Path) -> None:
    try:
        from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    except ImportError as e:
        report["transformers"] = {"skipped": f"transformers not importable: {e}"}
        return
    import transformers
    from safetensors.torch import load_file

    cfg_json = json.loads((path / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "tie_word_embeddings")
    cfg = Qwen3Config(**{k: cfg_json[k] for k in keys if k in cfg_json})
    dtype = torch.bfloat16
    with torch.device(args.device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    state = load_file(str(path / "model.safetensors"), device=args.device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"Qwen3ForCausalLM did not take the SDAR weights: {missing[:4]} {unexpected[:4]}")
    model.tie_weights()
    model.eval()
    rows = []
    report["transformers"] = {"version": transformers.__version__, "rows": rows}

    def generate(batch: int, gen_cfg) -> dict:
        ids = torch.tensor(prompts(batch, args.prompt_len, cfg.vocab_size, seed=batch), device=args.device)
        sync(args.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
        sync(args.device)
        seconds = time.perf_counter() - t0
        new = res.shape[1] - ids.shape[1]
        return {"tokens": batch * new, "seconds": seconds, "tokens_per_s": batch * new / seconds,
                "ms_per_forward": 1000 * seconds / max(new, 1), "tokens_per_forward": 1.0}

    base = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0)
    for batch in args.batches:
        if over_budget(args, 20):
            rows.append({"cache": "dynamic", "batch": batch, "skipped": "time budget"})
            continue
        gen_cfg = GenerationConfig(**base)
        generate(batch, gen_cfg)  # warm-up
        r = generate(batch, gen_cfg)
        rows.append({"cache": "dynamic", "batch": batch, **r})
        log(f"transformers dynamic batch={batch}: {r['tokens_per_s']:,.0f} tokens/s, "
            f"{r['ms_per_forward']:.2f} ms/forward")
        save(report, out)
    if args.tiny or over_budget(args, 150):
        rows.append({"cache": "static+compile", "batch": 1, "skipped": "--tiny" if args.tiny else "time budget"})
        return
    try:
        from transformers import CompileConfig

        gen_cfg = GenerationConfig(**base, cache_implementation="static",
                                   compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
        t0 = time.perf_counter()
        generate(1, gen_cfg)  # compiles
        generate(1, gen_cfg)  # reduce-overhead records its graphs on the second call
        compile_s = time.perf_counter() - t0
        r = generate(1, gen_cfg)
        rows.append({"cache": "static+compile", "batch": 1, **r, "compile_and_warmup_s": compile_s})
        log(f"transformers static+compile batch=1: {r['tokens_per_s']:,.0f} tokens/s (compile {compile_s:.0f} s)")
    except Exception as e:  # a transformers release without CompileConfig or a compile failure: say so
        rows.append({"cache": "static+compile", "batch": 1, "error": str(e).splitlines()[0][:300]})


def guarded(name: str, report: dict, fn, *args) -> None:
    """Run one part; an exception is recorded (report["errors"]) and printed, and the check goes on, so that one
    GPU call brings back every part that works."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the point is to keep going
        import traceback

        traceback.print_exc()
        report.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        log(f"{name} failed: {e!r}")


def over_budget(args, need_s: float) -> bool:
    """Whether a section of need_s seconds would end past the budget, less what is kept for the sections after it
    (args.reserve_s: the MoE shape's time while the dense shape runs)."""
    return time.monotonic() - START + need_s + getattr(args, "reserve_s", 0.0) > args.budget_s


def save(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    public = {k: v for k, v in report.items() if not k.startswith("_")}
    (out / "block_check.json").write_text(json.dumps(public, indent=1) + "\n")


HEADER = ["| engine | batch | decoding | tokens/s | ms/forward | tokens/forward per request |",
          "|---|---:|---|---:|---:|---:|"]


def engine_rows(rows: list[dict], cuda: bool) -> list[str]:
    md = []
    for r in rows:
        if "static" not in r:  # a whole section skipped
            md.append(f"| (section skipped: {r.get('skipped')}) | | | | | |")
            continue
        name = ("unmask static step" + (" (CUDA graphs)" if r.get("graphs") else " (no capture)") * cuda
                if r["static"] else "unmask eager")
        if "skipped" in r:
            md.append(f"| {name} | {r['batch']} | {r['mode']} | skipped ({r['skipped']}) | | |")
            continue
        md.append(f"| {name} | {r['batch']} | {r['mode']} | {r['tokens_per_s']:,.0f} | {r['ms_per_forward']:.2f} "
                  f"| {r['tokens_per_forward']:.2f} |")
    return md


def checks(report: dict, identity: str, syncs: str) -> list[str]:
    md = []
    ident = report.get(identity)
    if ident:
        md.append(f"\nStatic step vs eager: {ident['identical_requests']}/{ident['of']} requests token-identical.")
    for name, row in report.get(syncs, {}).items():
        cuda = (f", {row['cuda_sync_calls_per_step']:.2f} synchronising CUDA calls per step "
                f"({', '.join(row['cuda_sync_names'])})") if "cuda_sync_calls_per_step" in row else ""
        md.append(f"\nHost reads per step, {name}: {row['host_reads_per_step']:.2f}{cuda}.")
    times = report.get(syncs.replace("host_syncs", "host_time"), [])
    if times:
        md += ["\nWhere a static step's time goes (ms per engine step, topk 4: planning, staging the inputs, waiting "
               "in the one read, reading the proposals out, committing, the rest; the share of the requests' rows "
               "the host staged):\n",
               "| batch | ms/step | plan | stage | wait | read | commit | rest | rows staged |",
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        md += [f"| {t['batch']} | {t['ms_per_step']:.3f} | {t['plan']:.3f} | {t['stage']:.3f} | {t['wait']:.3f} "
               f"| {t['read']:.3f} | {t['commit']:.3f} | {t['rest']:.3f} | {t['staged']:.0%} |" for t in times]
    return md


def markdown(report: dict) -> str:
    cuda = report["device"].startswith("cuda")
    md = [f"# Block-causal fast path: {report['name']} ({report['device']}), torch {report['torch']}, bf16, "
          f"prompt {report['prompt_len']}, {report['max_tokens']} new tokens\n"]
    if "unmask" in report:
        md += [f"## {report['shape']} shape (SDAR's format, {report['parameters'] / 1e9:.2f}B parameters)\n", *HEADER,
               *engine_rows(report["unmask"], cuda)]
        hf = report.get("transformers", {})
        for r in hf.get("rows", []):
            name = f"transformers {hf.get('version', '')} generate, {r['cache']} cache"
            if "tokens_per_s" not in r:
                md.append(f"| {name} | {r['batch']} | next token | {r.get('skipped') or r.get('error')} | | |")
                continue
            md.append(f"| {name} | {r['batch']} | next token | {r['tokens_per_s']:,.0f} | {r['ms_per_forward']:.2f} "
                      f"| {r['tokens_per_forward']:.2f} |")
        if "skipped" in hf:
            md.append(f"\ntransformers: {hf['skipped']}")
        md += checks(report, "identity", "host_syncs")
    if "moe" in report:
        shape = report.get("moe_shape", {})
        built = (f", {shape['parameters'] / 1e9:.2f}B parameters drawn on the device in {shape['build_s']:.0f} s"
                 if shape else "")
        md += [f"\n## {shape.get('name', 'LLaDA2.0-mini')} MoE shape{built}\n", *HEADER,
               *engine_rows(report["moe"], cuda), *checks(report, "moe_identity", "moe_host_syncs")]
    for err in report.get("errors", []):
        md.append(f"\nFailed: {err}")
    return "\n".join(md) + "\n"


def run(args) -> dict:
    """The whole check (args: device, out, tiny, batches, prompt_len, max_tokens, budget_s)."""
    import platform
    import tempfile

    from unmask.models.loader import load_model

    report = {"device": args.device, "torch": torch.__version__, "shape": "tiny" if args.tiny else "Qwen3-1.7B",
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()}
    if args.shapes in ("all", "qwen3-1.7b"):
        args.reserve_s = args.moe_reserve_s if args.shapes == "all" else 0.0
        tmp = Path(tempfile.mkdtemp())
        path = build_checkpoint(tmp / "sdar", args.tiny)
        log(f"checkpoint written: {path}")
        model, spec = load_model(path, dtype="bfloat16", device=args.device)
        report["parameters"] = sum(p.numel() for p in model.parameters())
        unmask_speed(model, spec, args, report, args.out)
        guarded("host syncs", report, host_syncs, model, spec, args, report)
        guarded("host time", report, host_time, model, spec, args, report)
        save(report, args.out)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        guarded("transformers", report, hf_speed, path, args, report, args.out)
        save(report, args.out)
    if args.shapes in ("all", "llada2-mini"):  # what the time budget leaves (or a call of its own)
        from device_check_moe import run_moe

        args.reserve_s = 0.0
        guarded("moe", report, run_moe, args, report)
        save(report, args.out)
    md = markdown(report)
    (args.out / "block_check.md").write_text(md)
    print(md)
    return report
