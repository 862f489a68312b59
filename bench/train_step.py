"""Training step time, eager vs `--compile` (unmask.train.trainer.compile_blocks), interleaved A/B.

    python bench/train_step.py [--model DIR] [--batch 16] [--seq-len 512] [--rounds 4] [--threads 2]

One block-diffusion training step (the [x_t ; x_0] pass, backward, bf16 autocast as the trainer runs it)
on random tokens, for the same model twice: as loaded, and with every transformer block compiled in place.
The first compiled steps (compilation) are timed separately; then the two alternate for --rounds rounds,
with the block size drawn from the trainer's default set, and the per-round ratio eager / compiled is
reported as median [min-max]. Also prints the loss of both on one identical batch (they must agree to
rounding).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the built-in model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from unmask.defaults import default_model_path
    from unmask.models.loader import load_model
    from unmask.train.objectives import Objective, diffusion_loss_sum, draw_noise
    from unmask.train.trainer import DEFAULT_BLOCK_SIZES, compile_blocks

    eager, spec = load_model(args.model or default_model_path(), dtype="float32")
    eager.train()
    for p in eager.parameters():
        p.requires_grad_(True)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    obj = Objective(mask_id=spec.mask_id, block_sizes=DEFAULT_BLOCK_SIZES, shift=spec.shift)
    x0 = torch.randint(16, spec.arch.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(x0, dtype=torch.bool)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    def step(model, seed: int) -> float:
        noise = draw_noise(obj, loss_mask, torch.Generator().manual_seed(seed))
        with autocast:
            loss = diffusion_loss_sum(model, x0, noise, obj) / loss_mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    t0 = time.perf_counter()
    for s in range(len(DEFAULT_BLOCK_SIZES) + 1):  # every block size's mask shape once, plus one
        step(compiled, s)
    compile_s = time.perf_counter() - t0
    le, lc = step(eager, 99), step(compiled, 99)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for r in range(args.rounds):
        for name, model in (("eager", eager), ("compiled", compiled)) if r % 2 == 0 else \
                (("compiled", compiled), ("eager", eager)):
            t = time.perf_counter()
            step(model, 1000 + r)
            times[name].append(time.perf_counter() - t)
    ratios = [a / b for a, b in zip(times["eager"], times["compiled"])]
    print(f"model {spec.path.name}, batch {args.batch} x {args.seq_len}, torch threads {torch.get_num_threads()}")
    print(f"compiling: {compile_s:.1f} s for the first {len(DEFAULT_BLOCK_SIZES) + 1} compiled steps")
    print(f"loss on one batch: eager {le:.6f}, compiled {lc:.6f} (relative difference {abs(le - lc) / abs(le):.1e})")
    for name, ts in times.items():
        print(f"{name:>9}: step {statistics.median(ts):.2f} s [{min(ts):.2f}-{max(ts):.2f}]")
    print(f"eager / compiled per round: median {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
