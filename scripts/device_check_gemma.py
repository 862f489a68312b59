"""DiffusionGemma on an accelerator: unmask's native path against transformers' reference, correctness then speed.

    PYTHONUNBUFFERED=1 python3 scripts/device_check_gemma.py --out $OUT          # on a lent GPU machine
    python scripts/device_check_gemma.py --device cpu --quick --out /tmp/dgc     # the same code path here

1. Correctness, float32 with TF32 off, on the tiny random checkpoints of tests/test_diffusion_gemma.py:
   encoder and decoder logits (with and without self-conditioning) against the reference's on the same
   device (max abs difference, prompts of 5, 40 and 300 tokens), and generations token for token against the
   reference's `generate` with the same seed (canvas lengths 4, 8 and 16, a prompt longer than a block, and
   five concurrent requests of different canvas lengths and step caps in one engine).
2. unmask with and without CUDA graphs on the same prompts and seeds (tokens, wall time, captures/replays).
3. Where the time goes: torch profiler tables (top ops by self CPU time) of one sequential request in each.
4. Speed: bench/diffusion_gemma.py (interleaved A/B rounds, unmask / reference tokens/s) on a 167M-parameter
   random checkpoint, several workloads, each under its own time limit.

Writes gemma_check.json, gemma_check.md and profile_*.txt under --out. Imports torch, transformers, pytest
(for the test module's checkpoint builder) and unmask from this checkout: no server packages.

As run on a lent H200 (2026-12-04; ~4 min with --skip profile, ~2 min more for the profiler): that machine's
transformers (5.17) is older than the one the tests pin behaviour to and its reference differed from 5.25's
in one tiny generation case, so transformers 5.25.0, huggingface_hub 2.4.0, httpx2 / httpcore2 2.16.2 and
truststore travelled as wheels (`pip download --no-deps --python-version 3.12 ...` into an ignored .whl/),
installed with `pip install --no-deps --target /tmp/site` and put on PYTHONPATH; USE_HUB_KERNELS=0, since
transformers' hub kernels need the `kernels` package and a network. Results: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in ("src", "tests", "bench"):
    sys.path.insert(0, str(ROOT / p))
START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def logits_gaps(T, ckpt: Path, device: str) -> dict:
    """Max abs logit difference, unmask vs reference, both on `device` (float32)."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    from unmask.models.attention import AttentionBatch, Segment
    from unmask.models.loader import load_model

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(ckpt).to(device).eval()
    model, _ = load_model(ckpt, dtype="float32", device=device)
    # the cache keyword was renamed between transformers releases (past_key_values -> cache)
    kv = "cache" if "cache" in inspect.signature(type(ref).forward).parameters else "past_key_values"
    out = {}
    for p in (5, 40, 300):
        g = torch.Generator().manual_seed(p)
        prompt = torch.randint(3, T.VOCAB, (1, p), generator=g).to(device)
        canvas = torch.randint(0, T.VOCAB, (1, 8), generator=g).to(device)
        sc = (torch.randn(1, 8, T.VOCAB, generator=g) * 3).to(device)
        gaps = {}
        for name, sc_in in (("decoder", None), ("decoder_self_conditioned", sc)):
            cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
            enc = ref.model.encoder(input_ids=prompt, **{kv: cache}, position_ids=torch.arange(p, device=device)[None])
            want = ref(decoder_input_ids=canvas, **{kv: cache}, self_conditioning_logits=sc_in,
                       decoder_position_ids=torch.arange(p, p + 8, device=device)[None]).logits[0]
            c = model.new_cache(p + 8)
            seg = Segment(start=0, length=p, write=p, cache=c, extra={"encoder": p})
            h = model(prompt[0], torch.arange(p, device=device), AttentionBatch([seg]).prepare())
            if name == "decoder":
                ref_enc = torch.tanh(ref.lm_head(enc.last_hidden_state[0]).float() / 30) * 30
                gaps["encoder"] = (model.logits(h) - ref_enc).abs().max().item()
            c.length = p
            seg = Segment(start=p, length=8, write=0, cache=c,
                          extra={"encoder": 0, "sc_logits": None if sc_in is None else sc_in[0]})
            h = model(canvas[0], torch.arange(p, p + 8, device=device), AttentionBatch([seg]).prepare())
            gaps[name] = (model.logits(h) - want).abs().max().item()
        out[f"prompt_{p}"] = gaps
    return out


def generations(T, ckpt: Path, device: str) -> dict:
    """Token identity with the reference's generate on `device`: T's cases, then five concurrent requests."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from unmask.engine.engine import Engine
    from unmask.engine.params import GenerationParams
    from unmask.models.loader import load_model

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(ckpt).to(device).eval()
    model, spec = load_model(ckpt, dtype="float32", device=device)

    def ref_gen(prompt, seed, canvas, **kw):
        ref.config.canvas_length = canvas
        torch.manual_seed(seed)
        with torch.no_grad():
            return ref.generate(torch.tensor([prompt], device=device), **kw).sequences[0, len(prompt):].tolist()

    res = {"single": [], "batch": None}
    for canvas, plen, max_new, steps, stop in ((4, 6, 12, 6, {}), (8, 21, 20, 8, T.EARLY), (16, 3, 32, 10, T.EARLY),
                                               (16, 40, 48, 12, T.EARLY)):
        g = torch.Generator().manual_seed(canvas * 100 + plen)
        prompt = torch.randint(3, T.VOCAB, (plen,), generator=g).tolist()
        seed = 1000 + canvas
        want = ref_gen(prompt, seed, canvas, max_new_tokens=max_new, max_denoising_steps=steps, **stop)[:max_new]
        eng = Engine(model, spec)
        seq = eng.add_request(prompt, GenerationParams(max_tokens=max_new, steps=steps, block_size=canvas,
                                                       seed=seed, **stop))
        eng.run_to_completion()
        gr = eng.runner.graphs
        res["single"].append({"canvas": canvas, "prompt_len": plen, "max_new": max_new,
                              "identical": seq.output_ids == want, "tokens": len(want),
                              "graph_replays": gr.replays if gr else None,
                              "graphs_enabled": gr.enabled if gr else None})
    g = torch.Generator().manual_seed(9)
    cases = [(5, 8, 6), (19, 4, 5), (2, 8, 8), (33, 16, 4), (11, 8, 6)]
    prompts = [torch.randint(3, T.VOCAB, (n,), generator=g).tolist() for n, _, _ in cases]
    eng = Engine(model, spec)
    seqs = [eng.add_request(p, GenerationParams(max_tokens=16, steps=s, block_size=c, seed=50 + i, **T.EARLY))
            for i, (p, (_, c, s)) in enumerate(zip(prompts, cases))]
    eng.run_to_completion()
    same = [seqs[i].output_ids == ref_gen(p, 50 + i, c, max_new_tokens=16, max_denoising_steps=s, **T.EARLY)[:16]
            for i, (p, (_, c, s)) in enumerate(zip(prompts, cases))]
    res["batch"] = {"identical": sum(same), "of": len(same)}
    return res


def graph_equality(ckpt: Path, device: str, dtype: str) -> dict:
    """unmask with and without CUDA graphs on the same prompts and seeds: tokens, wall time, captures/replays."""
    from unmask.engine.engine import Engine
    from unmask.engine.graphs import DecodeGraphs
    from unmask.engine.params import GenerationParams
    from unmask.models.loader import load_model

    model, spec = load_model(ckpt, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, spec.arch.vocab_size, (n,), generator=g).tolist() for n in (9, 33, 60, 17)]
    res = {}
    for name in ("eager", "graphs", "graphs_again"):
        eng = Engine(model, spec, max_num_seqs=8)
        if name == "eager":
            eng.runner.graphs = None
        elif eng.runner.graphs is None:  # off the GPU: the emulated bookkeeping
            eng.runner.graphs = DecodeGraphs(model, torch.device(device), emulate=True)
        outs = []
        sync(device)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            s = eng.add_request(p, GenerationParams(max_tokens=48, steps=16, seed=i))
            eng.run_to_completion()
            outs.append(s.output_ids)
        sync(device)
        gr = eng.runner.graphs
        res[name] = {"wall_s": time.perf_counter() - t0, "steps": eng.stats.steps, "tokens": outs,
                     "captures": gr.captures if gr else 0, "replays": gr.replays if gr else 0,
                     "enabled": gr.enabled if gr else False}
    same = res["eager"]["tokens"] == res["graphs"]["tokens"] == res["graphs_again"]["tokens"]
    for r in res.values():
        r.pop("tokens")
    return {"identical": same, **res}


def profile(ckpt: Path, device: str, dtype: str, out: Path, max_new: int) -> dict:
    """Self-CPU-time tables of one 32-token-prompt request in each system, and their wall times."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    from unmask.engine.engine import Engine
    from unmask.engine.params import GenerationParams
    from unmask.models.loader import load_model

    hf_logging.set_verbosity_error()
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(ckpt, dtype=dt).to(device).eval()
    model, spec = load_model(ckpt, dtype=dtype, device=device)
    prompt = torch.randint(3, spec.arch.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    kw = dict(max_new_tokens=max_new, max_denoising_steps=16)

    def run_ref():
        torch.manual_seed(0)
        with torch.no_grad():
            ref.generate(torch.tensor([prompt], device=device), **kw)

    def run_unmask():
        eng = Engine(model, spec)
        s = eng.add_request(prompt, GenerationParams(max_tokens=max_new, steps=16, seed=0))
        eng.run_to_completion()
        return eng.stats.steps, s

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    res = {}
    for name, fn in (("reference", run_ref), ("unmask", run_unmask)):
        fn()  # warm-up
        sync(device)
        t0 = time.perf_counter()
        r = fn()
        sync(device)
        res[f"{name}_wall_s"] = time.perf_counter() - t0
        if name == "unmask":
            res["unmask_steps"] = r[0]
        with tprofile(activities=acts) as prof:
            fn()
            sync(device)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (out / f"profile_{name}.txt").write_text(table + "\n")
        ev = {e.key: e.count for e in prof.key_averages()}
        res[f"{name}_syncs"] = {k: v for k, v in ev.items() if "Synchronize" in k or "Memcpy" in k or k == "aten::item"}
        res[f"{name}_launches"] = sum(v for k, v in ev.items() if k in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                         "cudaLaunchKernelExC"))
    return res


def bench(model: Path, device: str, args: list[str], limit: float, extra_env: dict) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "diffusion_gemma.py"), "--model", str(model), "--device", device,
           *args]
    paths = [str(ROOT / p) for p in ("src", "tests")] + [x for x in [os.environ.get("PYTHONPATH")] if x]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **extra_env)
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"args": args, "error": f"timed out after {limit:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"args": args, "error": (p.stderr or p.stdout)[-1500:]}
    print(p.stdout, flush=True)
    r = json.loads(lines[-1])
    r["args"], r["wall_s"] = args, time.monotonic() - t0
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "gemma-check")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every part")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; workloads that would start later are skipped")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: correctness,graphs,profile,bench")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    report: dict = {"device": args.device, "torch": torch.__version__, "transformers": transformers.__version__,
                    "name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    log(f"{report}")
    tmp = Path(tempfile.mkdtemp())

    def save():
        (args.out / "gemma_check.json").write_text(json.dumps(report, indent=1) + "\n")

    if "correctness" not in skip:
        import test_diffusion_gemma as T

        small = T.make_checkpoint(tmp / "dg-logits", seed=1, embed_std=0.3)
        report["logits_max_abs_diff"] = logits_gaps(T, small, args.device)
        log(f"logits: {report['logits_max_abs_diff']}")
        ckpt = T.make_checkpoint(tmp / "dg-gen")
        report["generations"] = generations(T, ckpt, args.device)
        log(f"generations: {report['generations']}")
        save()

    size = ["--hidden", "128", "--layers", "2", "--vocab", "1024"] if args.quick else \
        ["--hidden", "1024", "--layers", "8", "--vocab", "32768"]
    mid = tmp / "dg-mid"
    subprocess.run([sys.executable, str(ROOT / "bench" / "diffusion_gemma.py"), "--make-tiny", str(mid), *size],
                   check=True, capture_output=True)
    log("built the speed checkpoint")
    if "graphs" not in skip:
        report["graphs_bf16"] = graph_equality(mid, args.device, "bfloat16" if args.device.startswith("cuda") else
                                               "float32")
        log(f"graphs: {report['graphs_bf16']}")
        save()
    if "profile" not in skip:
        try:
            report["profile_bf16"] = profile(mid, args.device, "bfloat16" if args.device.startswith("cuda") else
                                             "float32", args.out, 16 if args.quick else 64)
        except Exception as e:  # a profiler that cannot run here must not cost the speed figures
            report["profile_bf16"] = {"error": repr(e)[-500:]}
        log(f"profile: {report['profile_bf16']}")
        save()

    reps = ["--reps", "2"] if args.quick else ["--reps", "3"]
    req = ["--requests", "3", "--max-new-tokens", "32"] if args.quick else ["--requests", "4", "--max-new-tokens",
                                                                             "32"]
    bf16 = ["--dtype", "bfloat16"] if args.device.startswith("cuda") else []
    off = {"UNMASK_CUDA_GRAPHS": "0"}
    workloads = [  # most important first: the budget may cut the tail
        ("bf16, CUDA graphs", [*bf16, *reps, *req, "--mode", "both"], {}, 90),
        ("bf16, no CUDA graphs", [*bf16, *reps, *req, "--mode", "both"], off, 90),
        ("fp32 sequential, token identity", [*reps, *req, "--mode", "sequential", "--requests", "2"], {}, 60),
        ("bf16, 16 concurrent, mixed lengths", [*bf16, *reps, "--mode", "concurrent", "--requests",
                                                "6" if args.quick else "16", "--mixed-lengths",
                                                "--max-new-tokens", "32"], {}, 60),
        ("bf16 lean draws", [*bf16, *reps, *req, "--mode", "both", "--draws", "lean"], {}, 60),
        ("bf16 staggered arrivals: graphs vs eager", [*bf16, *reps, "--mode", "staggered", "--requests", "8",
                                                       "--stagger", "3", "--max-new-tokens", "32"], {}, 60),
    ]
    report["speed"] = []
    if "bench" not in skip:
        for name, wargs, env, limit in workloads:
            left = args.budget - (time.monotonic() - START)
            if left < 30:
                report["speed"].append({"name": name, "skipped": "budget"})
                continue
            r = bench(mid, args.device, wargs, min(limit, left), env)
            r["name"] = name
            report["speed"].append(r)
            log(f"{name}: " + json.dumps({k: v for k, v in r.items() if k in ("results", "error")}))
            save()

    md = [f"# DiffusionGemma device check: {report['name']} ({args.device}), torch {report['torch']}, "
          f"transformers {report['transformers']}\n"]
    if "logits_max_abs_diff" in report:
        md += ["| prompt | encoder | decoder | decoder, self-conditioned |", "|---|---:|---:|---:|"]
        for k, g in report["logits_max_abs_diff"].items():
            md.append(f"| {k} | {g['encoder']:.2e} | {g['decoder']:.2e} | {g['decoder_self_conditioned']:.2e} |")
        gen = report["generations"]
        md.append("\nGenerations token-identical to the reference: " +
                  ", ".join(f"canvas {s['canvas']} prompt {s['prompt_len']}: {s['identical']}" for s in gen["single"])
                  + f"; batch of 5: {gen['batch']['identical']}/{gen['batch']['of']}\n")
    if "graphs_bf16" in report:
        md.append(f"CUDA graphs vs eager (unmask alone, same seeds): {json.dumps(report['graphs_bf16'])}\n")
    md += ["| workload | mode | ref tok/s | unmask tok/s | ratio median [min-max] | identical |",
           "|---|---|---:|---:|---:|---|"]
    for w in report["speed"]:
        if "results" not in w:
            md.append(f"| {w['name']} | {w.get('skipped') or w.get('error', '')[-200:]!r} | | | | |")
            continue
        for r in w["results"]:
            if r["mode"] == "staggered":  # unmask against itself: graphs in the ratio column, eager as "ref"
                md.append(f"| {w['name']} | staggered (eager vs graphs) | {r['eager_tps']:.0f} | {r['graphs_tps']:.0f} | "
                          f"{r['ratio_median']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] | - |")
                continue
            md.append(f"| {w['name']} | {r['mode']} | {r['ref_tps']:.0f} | {r['unmask_tps']:.0f} | "
                      f"{r['ratio_median']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] | {r['identical']} |")
    save()
    (args.out / "gemma_check.md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)


if __name__ == "__main__":
    main()
