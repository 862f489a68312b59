"""Decode benchmark: tokens/s, forwards, tokens per forward, and the step time spent outside the forward.

    python bench/decode.py --model DIR [--policy threshold --threshold 0.9 --block-size 8 --batch 1 --reps 5]
                           [--dtype auto|float32|bfloat16|float32,bfloat16] [--linear packed|plain|packed,plain]

Prints a table, then one JSON line. Overhead = (step time - forward time) / forward time, where the
forward includes the output head; the rest is scheduling, planning, policies and bookkeeping. `--linear`:
`packed` runs the CPU linears through oneDNN on packed weights as `LLM` and the server do (models/cpu_linear.py),
`plain` through torch's default `F.linear`; every dtype x linear pair is a variant, alternated per repetition.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.models.cpu_linear import PackedLinear
from unmask.models.loader import dtype_name, load_model
from unmask.tokenizer import Tokenizer

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    \"\"\"A last-in first-out container.\"\"\"\n\n    def __init__(self):\n",
    "The json module can be used to",
]


def run_once(model, spec, prompts, params, max_num_seqs):
    eng = Engine(model, spec, max_num_seqs=max_num_seqs)
    seqs = [eng.add_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    eng.run_to_completion()
    wall = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for s in seqs)
    return {
        "tokens": tokens, "steps": eng.stats.steps, "wall_s": wall,
        "tokens_per_s": tokens / wall, "tokens_per_forward": tokens / max(eng.stats.steps, 1) / len(prompts),
        "overhead_share": eng.stats.overhead_share,
        "forward_ms": 1e3 * eng.stats.forward_s / max(eng.stats.steps, 1),
        "step_ms": 1e3 * eng.stats.step_s / max(eng.stats.steps, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="threshold")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--tokens-per-step", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto",
                    help="auto (the engine's default) | float32 | bfloat16; several, comma-separated, alternate "
                         "per repetition and the per-round tokens/s ratio of each to the first is reported")
    ap.add_argument("--linear", default="packed",
                    help="packed (oneDNN on packed weights, the engine's CPU default) | plain (F.linear); "
                         "comma-separated: both, as variants of every dtype")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from unmask.defaults import default_model_path

    path = args.model or default_model_path()
    kinds = [k.strip() for k in args.linear.split(",")]
    if not set(kinds) <= {"packed", "plain"}:
        raise SystemExit(f"--linear takes packed and/or plain, got {args.linear!r}")
    loaded, names = [], []
    for d in args.dtype.split(","):
        for kind in kinds:
            model, sp = load_model(path, dtype=d.strip(), packed_linears=kind == "packed")
            if kind == "packed" and not any(type(m) is PackedLinear for m in model.modules()):
                raise SystemExit("--linear packed: oneDNN's packed linear is not available here (or switched off)")
            loaded.append((model, sp))
            names.append(dtype_name(model.lm_head.weight.dtype) + ("" if len(kinds) == 1 else f"/{kind}"))
    spec = loaded[0][1]
    tok = Tokenizer(spec.path)
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]
    params = GenerationParams(max_tokens=args.max_tokens, policy=args.policy, threshold=args.threshold,
                              tokens_per_step=args.tokens_per_step, block_size=args.block_size, ignore_eos=True)
    runs: list[list[dict]] = [[] for _ in loaded]
    for model, sp in loaded:
        run_once(model, sp, prompts, params, args.batch)  # warm-up
    for rep in range(args.reps):
        order = range(len(loaded)) if rep % 2 == 0 else reversed(range(len(loaded)))
        for i in order:
            runs[i].append(run_once(*loaded[i], prompts, params, args.batch))
    print(f"model={spec.path.name} family={spec.family.name} policy={args.policy} batch={args.batch} "
          f"block={params.block_size or spec.block_size} threads={args.threads} reps={args.reps}")
    print(f"{'variant':<16} {'tokens/s':>10} {'tok/fwd':>8} {'steps':>6} {'fwd ms':>8} {'step ms':>8} {'overhead':>9} "
          f"{'ratio (min-max)':>20}")
    for name, rs in zip(names, runs):
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, runs[0])]
        ratio = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        print(f"{name:<16} {med['tokens_per_s']:10.1f} {med['tokens_per_forward']:8.2f} {med['steps']:6.0f} "
              f"{med['forward_ms']:8.2f} {med['step_ms']:8.2f} {med['overhead_share']:9.1%} "
              f"{ratio['median']:8.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})")
        print(json.dumps({"bench": "decode", "model": str(spec.path.name), "variant": name, "policy": args.policy,
                          "batch": args.batch, "median": med, "ratio_to_first": ratio,
                          "min_tokens_per_s": min(r["tokens_per_s"] for r in rs),
                          "max_tokens_per_s": max(r["tokens_per_s"] for r in rs)}))


if __name__ == "__main__":
    main()
