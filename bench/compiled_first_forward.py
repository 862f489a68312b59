"""A request's first forward (its prompt and first drafts) through the compiled CPU step against eagerly.

The time to first token of held-out next lines at batch 1 (max_tokens 1; `--max-tokens 48`: whole answers, to
the end of the line; bfloat16, the model's default policy),
with the compiled step taking a request alone up to `--width` tokens (MAX_WIDTH_ALONE: its prompt's forward
compiled) against up to 64 (decode steps only: the prompt's forward eager). Each side runs in a child process of
its own (the limit is read when a step is planned), without a prefix cache, 5 timed passes over the tasks after
an untimed one, in rounds that alternate the order; the median ms per request of each side and their ratio.

    .venv/bin/python bench/compiled_first_forward.py --model src/unmask/assets/unmask-tiny --json F
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchlib import line_children
from benchlib.common import write_json


def child(args) -> list[float]:
    import torch

    from unmask.engine import compiled_step
    from unmask.engine.engine import Engine
    from unmask.engine.llm import LLM

    compiled_step.MAX_WIDTH_ALONE = args.limit
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="bfloat16", device="cpu")
    # no prefix cache: every pass feeds the whole prompt, as a request of a new file would
    llm.engine = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=1, prefix_cache_bytes=0, compile_step=True)
    prompts, params = line_children.line_requests(llm, args, args.max_tokens)
    for p, q in zip(prompts, params):   # untimed: oneDNN's packing, allocator warm-up
        llm.generate([p], [q])
    per_pass = []
    for _ in range(5):
        t0 = time.perf_counter()
        for p, q in zip(prompts, params):
            llm.generate([p], [q])
        per_pass.append((time.perf_counter() - t0) / len(prompts) * 1000)
    return per_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    line_children.add_args(ap)
    ap.add_argument("--width", type=int, default=512, help="tokens a request alone may feed compiled")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=1, help="1: the first token; 48: whole answers")
    ap.add_argument("--limit", type=int, help=argparse.SUPPRESS)   # the child's
    args = ap.parse_args()
    if args.limit:
        print(json.dumps(child(args)))
        return
    sides = {"eager_prompt": 64, "compiled_prompt": args.width}
    ms: dict[str, list[float]] = {n: [] for n in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            ms[name] += line_children.run_child(__file__, args, ["--limit", str(sides[name]), "--max-tokens",
                                                                  str(args.max_tokens)], name)
    med = {n: statistics.median(v) for n, v in ms.items()}
    ratio = med["eager_prompt"] / med["compiled_prompt"]
    print(f"ms per request, max_tokens {args.max_tokens} (median of {len(ms['eager_prompt'])} passes over "
          f"{args.tasks} prompts): prompt eager {med['eager_prompt']:.1f}, prompt compiled "
          f"{med['compiled_prompt']:.1f}: x{ratio:.2f}")
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "tasks": args.tasks, "max_tokens": args.max_tokens,
                               "ms_per_request": ms, "median": med, "speedup": ratio})


if __name__ == "__main__":
    main()
