"""How many tokens per decoding forward `speculative` could reach with perfect drafts, on the model card's held-out
tasks, against what it reaches: the ceiling that the answers' own lengths put on issue 29's 3-tokens goal.

A self-speculative step writes the verifier's token plus the drafts it keeps, and the diffusion drafts come from
the previous step's draft block (rows 0..B-2 of a block of B), so with perfect drafts a step writes at most B
tokens, and the first step of an answer, which has no previous step, writes one (its only drafts are copies: the
prompt lookup and the n-gram table, which may run past B). An answer of n tokens thus takes at least
1 + ceil((n - 1) / B) decoding forwards, and the tokens per forward of a task kind are bounded by
sum(n) / sum(1 + ceil((n - 1) / B)) over the model's own answers (the same tokens that the eval counts).

    .venv/bin/python bench/draft_bound.py --model bench/models/unmask-tiny-5m-from-twin --json F

Counts only (float32, the eval's tasks and max_tokens), no timing: safe to run beside other jobs.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import heldout  # noqa: E402
from unmask.engine.params import GenerationParams  # noqa: E402
from unmask.evaluation import FUNCTION_TOKENS, POLICIES  # noqa: E402

KINDS = ((1, "next_line"), (0, "infill"), (2, "function"))


def forwards_bound(lengths: list[int], block: int) -> int:
    """Fewest decoding forwards for answers of these lengths when every diffusion draft is kept."""
    return sum(1 + math.ceil((n - 1) / block) for n in lengths if n > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    heldout.add_args(ap)
    ap.add_argument("--policy", default="speculative_b4_lookup", help="an `unmask eval` policy name")
    ap.add_argument("--blocks", default="4,8,16", help="draft block sizes to bound")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    blocks = [int(b) for b in args.blocks.split(",")]
    llm, _, tasks = heldout.load(args)
    rows = []
    for kind, name in KINDS:
        ts = tasks[kind]
        max_tokens = FUNCTION_TOKENS if name == "function" else 48
        params = [GenerationParams(max_tokens=max_tokens, stop=list(t.stop), min_tokens=t.min_tokens,
                                   **POLICIES[args.policy]) for t in ts]
        outs = llm.generate([llm.encode(t.prompt) for t in ts], params)
        lengths = [len(o.token_ids) for o in outs]
        tokens, forwards = sum(lengths), sum(o.forwards - o.prefill_forwards for o in outs)
        row = dict(task=name, answers=len(ts), tokens=tokens, decoding_forwards=forwards,
                   mean_answer_tokens=tokens / len(ts), median_answer_tokens=statistics.median(lengths),
                   tokens_per_forward=tokens / forwards,
                   bound={str(b): tokens / forwards_bound(lengths, b) for b in blocks})
        rows.append(row)
        print(f"{name}: {len(ts)} answers, {tokens} tokens (mean {row['mean_answer_tokens']:.1f}, median "
              f"{row['median_answer_tokens']:g}), {row['tokens_per_forward']:.2f} tokens per decoding forward; "
              "perfect drafts: " + ", ".join(f"block {b} {v:.2f}" for b, v in row["bound"].items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(model=args.model, policy=args.policy, tasks=rows), indent=1))


if __name__ == "__main__":
    main()
