"""A/B of the split long-prefix attention path (models/attention.py `_attend_split`).

Chunked prefill of held-out text into the exact block-causal cache, then 16 decoded tokens, with the
split path on and off, interleaved per round (order alternated); median prefill seconds and the ratio.

    python bench/prefill_split.py --lengths 8192,16384 --threads 1 --rounds 2

Since 2026-12-05 a causal-context model's prompt chunks (the built-in model's) take the unmasked causal path
(attention._attend_causal), so here only the chunk that holds the first answer block still differs; the A/B of
that path is `bench/prefill_cost.py tune --causal-off`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

from benchlib.cost import CostBench, corpus_ids  # noqa: E402
from unmask.models import attention  # noqa: E402
from unmask.models.loader import load_model  # noqa: E402
from unmask.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "src/unmask/assets/unmask-tiny"))
    ap.add_argument("--corpus", default=str(ROOT / "data/corpus/heldout.jsonl"))
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    model, spec = load_model(args.model, dtype="float32")  # the float32 of the committed figures
    ids = corpus_ids(Tokenizer(args.model), args.corpus, max(lengths) + 8)
    bench = CostBench(model, spec, ids, max(lengths) + 200)
    default = attention.SPLIT_MIN_ELEMENTS
    runs: dict[tuple[int, bool], list[dict]] = {}
    for r in range(args.rounds):
        for L in lengths:
            for split in ((True, False) if r % 2 == 0 else (False, True)):
                attention.SPLIT_MIN_ELEMENTS = default if split else 1 << 62
                out = bench.prefill_run(L, 16)
                runs.setdefault((L, split), []).append(out)
                print(f"round {r} L={L} split={split}: prefill {out['prefill_s']:.2f} s, "
                      f"peak RSS growth {out['delta_mb']:.0f} MB", flush=True)
    attention.SPLIT_MIN_ELEMENTS = default
    for L in lengths:
        one = statistics.median(o["prefill_s"] for o in runs[(L, False)])
        two = statistics.median(o["prefill_s"] for o in runs[(L, True)])
        ratios = [a["prefill_s"] / b["prefill_s"] for a, b in zip(runs[(L, False)], runs[(L, True)])]
        print(f"L={L}: single masked call {one:.2f} s, split {two:.2f} s, speed-up median "
              f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
