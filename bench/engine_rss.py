"""Resident memory of an engine over many batches of varied prompts: does it level off once the prefix cache is full?

    .venv/bin/python bench/engine_rss.py --model bench/models/unmask-tiny-5m-drafter            # glibc
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 .venv/bin/python bench/engine_rss.py ...  # jemalloc

Prompts are cut from the training text at line ends (train.ngram_table.line_prompts: up to 1,200 characters), so
lengths vary as a server's do; each batch is one LLM.generate call of --batch requests, greedy, --tokens each.
Prints the process's RSS (/proc/self/statm), the allocator mapped, and the prefix cache's bytes every --every batches.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from unmask.allocator import active
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.train.ngram_table import line_prompts, text_documents


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench/models/unmask-tiny-5m-drafter")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--text", default="data/corpus")
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--every", type=int, default=3)
    args = ap.parse_args()
    texts = list(text_documents(Path(args.text)))[:3000]
    prompts = line_prompts(texts, args.batch * args.batches, seed=5)
    llm = LLM(args.model, dtype=args.dtype, ngram_drafts=False)
    params = GenerationParams(max_tokens=args.tokens, temperature=0.0)
    print(f"allocator {active()}, loaded: {rss_mb():.0f} MB", flush=True)
    for i in range(args.batches):
        llm.generate(prompts[i * args.batch:(i + 1) * args.batch], params)
        if (i + 1) % args.every == 0:
            cache = llm.engine.prefix_cache
            print(f"batch {i + 1}: {rss_mb():.0f} MB, prefix cache {cache.bytes / 2**20:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
