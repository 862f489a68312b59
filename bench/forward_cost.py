"""Why the CPU bounds the speed-up of parallel decoding: the cost of a decoding forward over q positions.

A diffusion model that commits q tokens per forward is q times faster than one-token decoding only if a
forward over its block costs what a one-token forward costs. On a GPU that nearly holds for small q (the step
is bound by reading the weights); on a CPU the matrix multiplies grow with q. This measures it through the
engine itself: the same prompts decoded with block size q and `topk` committing all q masked positions in
one step (so each decoding forward commits exactly q tokens, and also writes the previous block's K/V), against
block size 1. cost(q) = seconds per decoding forward at q over seconds per forward at 1; the best speed-up
any policy can reach at block q is then q / cost(q).

    python bench/forward_cost.py --model bench/models/unmask-tiny-5m --threads 2 --json docs/bench/forward-cost-5m.json

Batch 1, greedy, `ignore_eos`, `max_tokens` tokens per request; rounds interleave the block sizes (A B A B);
figures are medians over rounds with min and max. The prefill forward is timed apart and left out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchlib.common import write_json

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "bench/models/unmask-tiny-5m")
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from unmask.engine.engine import Engine
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    if sizes[0] != 1:
        sys.exit("--sizes must start with 1 (the one-token forward every cost is relative to)")
    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    llm.engine = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=1, prefix_cache_bytes=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(16, llm.spec.arch.vocab_size - 1, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.requests)]

    def per_forward(q: int) -> float:
        """Seconds per decoding forward at block size q (the request's first forward, its prefill, left out)."""
        params = GenerationParams(max_tokens=args.max_tokens, block_size=q, policy="topk", tokens_per_step=q,
                                  ignore_eos=True)
        total, forwards = 0.0, 0
        for p in prompts:
            stream = llm.stream(p, params)
            next(stream)  # prefill + the first block
            t0 = time.perf_counter()
            last = None
            for last in stream:
                pass
            total += time.perf_counter() - t0
            forwards += last.forwards - 1
        return total / forwards

    for q in sizes:  # warm-up
        per_forward(q)
    rounds = {q: [] for q in sizes}
    for r in range(args.rounds):
        for q in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
            rounds[q].append(per_forward(q))
    rows = []
    for q in sizes:
        ratios = [a / b for a, b in zip(rounds[q], rounds[1])]
        cost = statistics.median(ratios)
        rows.append({"q": q, "ms_per_forward": 1e3 * statistics.median(rounds[q]), "cost": cost,
                     "cost_min": min(ratios), "cost_max": max(ratios), "speedup_bound": q / cost})
    print(f"model {args.model}, {torch.get_num_threads()} thread(s), {args.dtype}, prompt {args.prompt_tokens}, "
          f"{args.max_tokens} tokens x {args.requests} requests, {args.rounds} rounds")
    print("| q (block = tokens per forward) | ms per forward | cost(q) / cost(1) [min-max] | bound on speed-up q / cost |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['q']} | {r['ms_per_forward']:.2f} | {r['cost']:.2f} [{r['cost_min']:.2f}-{r['cost_max']:.2f}] | "
              f"{r['speedup_bound']:.2f} |")
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "model": str(args.model),
                               "threads": torch.get_num_threads(), "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
