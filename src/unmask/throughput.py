"""Offline throughput of a model in this engine (`unmask bench`): what `vllm bench throughput` or
`llama-bench` report, for a diffusion model.

Each batch size gets random-token prompts (seeded; stop and mask tokens excluded) and generates exactly
max_tokens per request (EOS ignored), so every configuration does the same work. Batch sizes are
interleaved within each round (1, 4, 16, 1, 4, 16, ...) so that a machine that slows down slows them
alike, and each figure is a median with its min and max over the rounds.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from unmask.engine.params import GenerationParams


@dataclass
class BatchResult:
    batch: int
    tokens: int = 0                      # generated tokens per round (batch * max_tokens)
    seconds: list[float] = field(default_factory=list)
    forwards: list[int] = field(default_factory=list)         # engine steps per round
    tokens_per_forward: list[float] = field(default_factory=list)  # per request, averaged over the batch

    def summary(self) -> dict:
        tps = [self.tokens / s for s in self.seconds]
        return {"batch": self.batch, "tokens": self.tokens, "rounds": len(self.seconds),
                "tokens_per_s": _mm(tps), "seconds": _mm(self.seconds),
                "latency_ms_per_token": _mm([1000 * s / (self.tokens / self.batch) for s in self.seconds]),
                "engine_steps": _mm(self.forwards), "tokens_per_forward": _mm(self.tokens_per_forward)}


def _mm(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def random_prompts(llm, n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids drawn uniformly from the vocabulary minus stop and mask tokens."""
    vocab = llm.spec.arch.vocab_size
    banned = set(llm.spec.stop_ids) | ({llm.spec.mask_id} if llm.spec.mask_id is not None else set())
    allowed = torch.tensor([i for i in range(vocab) if i not in banned])
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (n, length), generator=g)].tolist()


def measure(llm, batches: list[int], prompt_len: int, max_tokens: int, rounds: int, knobs: dict,
            seed: int = 0, log=None) -> list[BatchResult]:
    """Time `llm.generate` for every batch size, `rounds` interleaved rounds, after one untimed warm-up."""
    if prompt_len + max_tokens > llm.spec.max_context:
        raise ValueError(f"prompt_len + max_tokens = {prompt_len + max_tokens} exceeds the model's context "
                         f"({llm.spec.max_context})")
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True, **knobs)
    llm.generate(random_prompts(llm, 1, prompt_len, seed), GenerationParams(max_tokens=min(8, max_tokens),
                                                                           ignore_eos=True, **knobs))
    results = [BatchResult(b, tokens=b * max_tokens) for b in batches]
    for r in range(rounds):
        for res in results:
            prompts = random_prompts(llm, res.batch, prompt_len, seed + 1000 * r + res.batch)
            steps0 = llm.engine.stats.steps
            t0 = time.perf_counter()
            outs = llm.generate(prompts, [params] * res.batch)
            res.seconds.append(time.perf_counter() - t0)
            res.forwards.append(llm.engine.stats.steps - steps0)
            res.tokens_per_forward.append(sum(o.tokens_per_forward for o in outs) / len(outs))
            if log:
                log(f"round {r + 1}/{rounds} batch {res.batch}: {res.tokens / res.seconds[-1]:.1f} tokens/s")
    return results
