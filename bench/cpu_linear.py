"""CPU linears: torch's default `F.linear` against oneDNN on a packed weight (unmask.models.cpu_linear).

    .venv/bin/python bench/cpu_linear.py [--threads 2] [--twin bench/models/ar-twin --tasks 30 --rounds 3]

Part 1, shapes: microseconds per call on random tensors at the built-in models' shapes (LM head 8,192 x 256, FFN
768 x 256 and 256 x 768, attention 256 x 256) and 1 to 20 rows, float32 and bfloat16, median of 5 loops, the two
paths alternating. Part 2 (--twin): the AR twin's plain greedy loop (the suite's `ar_twin_loop`) on held-out next
lines with plain and with packed linears, interleaved rounds: what the same kernels give a one-row-a-forward model.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = [(8192, 256), (768, 256), (256, 768), (256, 256)]
ROWS = [1, 4, 10, 20]


def per_call_us(f, calls: int = 200, loops: int = 5) -> float:
    for _ in range(20):
        f()
    times = []
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def shapes() -> None:
    from unmask.models.cpu_linear import pack_linears

    print(f"{'dtype':<9} {'weight':>10} {'rows':>4} {'F.linear us':>12} {'packed us':>10} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for out_f, in_f in SHAPES:
            lin = nn.Linear(in_f, out_f, bias=False).to(dtype)
            packed = copy.deepcopy(lin)
            if not pack_linears(nn.Sequential(packed)):
                sys.exit("oneDNN's packed linear is not available here")
            for rows in ROWS:
                x = torch.randn(rows, in_f).to(dtype)
                with torch.no_grad():
                    plain_us = per_call_us(lambda: F.linear(x, lin.weight))
                    # the oneDNN op itself, not the module: the float32 small-product rule would send the
                    # smallest calls back to F.linear and hide what oneDNN costs there
                    pack_us = per_call_us(lambda: torch.ops.mkldnn._linear_pointwise(
                        x, packed._pack, None, "none", [], ""))
                print(f"{str(dtype).split('.')[1]:<9} {out_f:>5}x{in_f:<4} {rows:>4} {plain_us:12.0f} {pack_us:10.0f} "
                      f"{plain_us / pack_us:6.2f}")


def twin_loop(path: Path, tasks_n: int, rounds: int) -> None:
    from benchlib import twin
    from unmask.evaluation import next_line_tasks
    from unmask.train.corpus import read_documents

    hf = twin.HFTwin(path)
    packed = twin.HFTwinLoop.sharing(hf)      # its own packed copy of the weights
    plain = twin.HFTwinLoop.sharing(hf)
    plain.model = hf.model                    # the plain weights generate() uses
    docs = list(read_documents(ROOT / "data/corpus/heldout.jsonl"))
    tasks = next_line_tasks(docs, tasks_n)
    ids = [hf.tok.encode(t.prompt, add_special_tokens=False) for t in tasks]

    def run(dec):
        t0, tokens, texts = time.perf_counter(), 0, []
        for i, t in zip(ids, tasks):
            r = dec.run(i, 48, True, t.min_tokens)
            tokens, texts = tokens + r.tokens, texts + [r.text]
        return tokens / (time.perf_counter() - t0), texts

    run(packed), run(plain)
    speed, texts = {"plain": [], "packed": []}, {}
    for r in range(rounds):
        order = [("plain", plain), ("packed", packed)]
        for name, dec in (order if r % 2 == 0 else order[::-1]):
            tps, texts[name] = run(dec)
            speed[name].append(tps)
    ratios = [b / a for a, b in zip(speed["plain"], speed["packed"])]
    print(f"twin loop, {len(tasks)} next lines, {rounds} rounds: plain {statistics.median(speed['plain']):.1f} "
          f"tokens/s, packed {statistics.median(speed['packed']):.1f}; per-round ratios "
          f"{', '.join(f'{x:.2f}' for x in ratios)}; same answers on "
          f"{sum(a == b for a, b in zip(texts['plain'], texts['packed']))}/{len(tasks)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--twin", type=Path, default=None)
    ap.add_argument("--tasks", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes()
    if args.twin is not None:
        twin_loop(args.twin, args.tasks, args.rounds)


if __name__ == "__main__":
    main()
