"""Batch scaling in the offline API: throughput at batch 1, 4, 16, 64 on the same work.

The same N held-out next-line prompts (N = the largest batch) are generated at every batch size b, as
N / b consecutive `LLM.generate` calls of b prompts each: every batch size does the same requests, so
throughput differences are batching alone. Greedy, the default policy (threshold 0.9), ignore_eos and a
fixed max_tokens, so every request produces the same number of tokens; prefix cache off. Batch sizes
are interleaved round by round (order rotated); speed-ups over batch 1 are per-round ratios.
"""
from __future__ import annotations

import time

from .common import ratio_summary, rotated, summary


def run_section(llm, prompts: list[list[int]], batches: list[int], max_tokens: int, rounds: int, log) -> dict:
    from unmask.engine.engine import Engine
    from unmask.engine.params import GenerationParams

    n = max(batches)
    prompts = [prompts[i % len(prompts)] for i in range(n)]
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    llm.engine = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=max(batches), max_batch_tokens=4096,
                        prefix_cache_bytes=0)

    def run(b: int) -> dict:
        eng = llm.engine
        s0, f0, bs0 = eng.stats.steps, eng.stats.forward_s, eng.stats.batch_size_sum
        tokens, forwards, latencies = 0, 0, []
        t0 = time.perf_counter()
        for i in range(0, n, b):
            tc = time.perf_counter()
            outs = llm.generate(prompts[i:i + b], params)
            latencies.append(time.perf_counter() - tc)
            tokens += sum(len(o.token_ids) for o in outs)
            forwards += sum(o.forwards for o in outs)
        wall = time.perf_counter() - t0
        steps = eng.stats.steps - s0
        return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "steps": steps,
                "requests_per_step": (eng.stats.batch_size_sum - bs0) / max(steps, 1),
                "tokens_per_forward": tokens / max(forwards, 1),
                "forward_share": (eng.stats.forward_s - f0) / wall,
                "latency_s": sum(latencies) / len(latencies)}

    run(min(batches))  # warm-up
    runs = {b: [] for b in batches}
    t_start = time.perf_counter()
    for r in range(rounds):
        for b in rotated(batches, r):
            runs[b].append(run(b))
        log(f"  batch: round {r + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s)")
    base = batches[0]
    rows = []
    for b in batches:
        rows.append({
            "batch": b,
            **{k: summary([x[k] for x in runs[b]]) for k in
               ("tokens_per_s", "latency_s", "requests_per_step", "tokens_per_forward", "forward_share", "wall_s")},
            "speedup_vs_batch1": ratio_summary([x["tokens_per_s"] for x in runs[b]],
                                               [x["tokens_per_s"] for x in runs[base]]),
        })
    return {"rows": rows, "requests": n, "max_tokens": max_tokens, "rounds": rounds, "policy": params.policy,
            "threshold": params.threshold, "seconds": time.perf_counter() - t_start}
