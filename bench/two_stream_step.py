"""Long-row training step: the dense [2L, 2L] block-diffusion mask against the split attention, interleaved A/B.

    python bench/two_stream_step.py [--model DIR] [--lengths 2048,4096,8192] [--block 8] [--rounds 3] [--threads 2]

One block-diffusion training step of one row of L random tokens (the [x_t ; x_0] pass and its backward, bf16
autocast as the trainer runs it, no optimizer) on the same model, its attention computed two ways: under the one
dense [2L, 2L] mask (`objectives._mask_on`, what every length used before), and split by what each row sees
(`models/two_stream.py`, what rows longer than two_stream.CHUNK now use). Per length: the loss of both on one batch
(they must agree to rounding), seconds a step as median [min-max] over --rounds interleaved rounds, the per-round
ratio dense / split, and the peak RSS growth of one step of each in a fresh process (--no-memory skips it).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _setup(model_dir, block: int):
    from unmask.defaults import default_model_path
    from unmask.models.loader import load_model
    from unmask.train.objectives import Objective

    model, spec = load_model(model_dir or default_model_path(), dtype="float32")
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    obj = Objective(mask_id=spec.mask_id, block_sizes=(block,), shift=spec.shift,
                    causal_context=spec.causal_context)
    return model, spec, obj


def _step(model, spec, obj, length: int, block: int, split: bool, seed: int) -> float:
    import unmask.train.objectives as objectives

    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randint(16, spec.arch.vocab_size, (1, length), generator=gen)
    loss_mask = torch.ones_like(x0, dtype=torch.bool)
    noise = objectives.draw_noise(obj, loss_mask, gen)
    chosen = objectives.use_two_stream
    objectives.use_two_stream = (lambda *a: True) if split else (lambda *a: False)  # this step's path only
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = objectives.diffusion_loss_sum(model, x0, noise, obj) / loss_mask.sum()
        loss.backward()
    finally:
        objectives.use_two_stream = chosen
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def child(args) -> None:
    model, spec, obj = _setup(args.model, args.block)
    before = _rss_kb()
    _step(model, spec, obj, args.child_length, args.block, args.child_split, 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mb": (peak - before) / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child-length", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-split", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_length:
        return child(args)

    model, spec, obj = _setup(args.model, args.block)
    print(f"model {spec.path.name}, block {args.block}, causal context {spec.causal_context}, "
          f"torch threads {torch.get_num_threads()}")
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        losses = {name: _step(model, spec, obj, length, args.block, name == "split", 7) for name in ("dense", "split")}
        times: dict[str, list[float]] = {"dense": [], "split": []}
        for r in range(args.rounds):
            for name in ("dense", "split") if r % 2 == 0 else ("split", "dense"):
                t = time.perf_counter()
                _step(model, spec, obj, length, args.block, name == "split", 100 + r)
                times[name].append(time.perf_counter() - t)
        ratios = [d / s for d, s in zip(times["dense"], times["split"])]
        row = {"length": length, "loss": losses, "seconds": times, "dense_over_split": ratios}
        if not args.no_memory:
            row["peak_rss_growth_mb"] = {}
            for name in ("dense", "split"):
                cmd = [sys.executable, __file__, "--block", str(args.block), "--child-length", str(length),
                       "--child-split", str(int(name == "split"))] + (["--model", str(args.model)] if args.model
                                                                     else []) + \
                      (["--threads", str(args.threads)] if args.threads else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                row["peak_rss_growth_mb"][name] = json.loads(out.strip().splitlines()[-1])["growth_mb"]
        rows.append(row)
        med = {k: statistics.median(v) for k, v in times.items()}
        mem = row.get("peak_rss_growth_mb")
        print(f"L {length:>6}: loss dense {losses['dense']:.5f} split {losses['split']:.5f}; step dense "
              f"{med['dense']:.2f} s [{min(times['dense']):.2f}-{max(times['dense']):.2f}], split {med['split']:.2f} s "
              f"[{min(times['split']):.2f}-{max(times['split']):.2f}]; dense/split {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]"
              + (f"; peak RSS growth dense {mem['dense']:.0f} MB, split {mem['split']:.0f} MB" if mem else ""),
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(spec.path), "block": args.block,
                                         "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
