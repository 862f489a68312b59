"""Cost growth: time per generated token and peak memory vs prompt length and vs generation length.

All runs: the engine directly (no tokenizer), batch 1, prefix cache off, greedy one token per forward
(`topk`, k = 1) with ignore_eos, so time per generated token = time per forward and the curve measures
the engine's cost, not a policy's confidence (divide by a policy's tokens per forward from the policy
table for its per-token time). Prompts are held-out corpus tokens, repeated when a length needs more.

Three measurements, each a list of lengths interleaved round by round (order rotated per round):

  prefill   the prompt goes through the engine's chunked prefill (max_batch_tokens 4096 per step) into
            the exact block-causal cache, then `decode_tokens` tokens are generated. Reported: prefill
            seconds (the chunk steps, the last one shared with the first block), decode seconds per
            generated token, peak RSS growth of the whole request.
  context   decode cost at a context of L tokens without paying an L-token prefill: the request's cache
            is filled by tiling the K/V of a real 512-token prefill up to L (keys re-rotated to their
            target positions), then `decode_tokens` tokens are generated through the normal engine step.
            The cache, masks and attention are exactly what a real L-token request decodes with; only
            the cached values are copies. Where both
            exist, it agrees with `prefill` (the table shows both).
  generate  a 64-token prompt, generation lengths 64 .. 2,048.

`run_long_prefill` (suite section `longprefill`, opt-in) repeats `prefill` at 32K .. 128K tokens. Attention
alone makes a real 128K-token prefill about 2.7e11 query-key products on 2 CPU cores (minutes per request),
so it runs one round, as its own section (`make bench` runs it after the interleaved suite); the report
merges its rows into the prefill columns.

Lengths past the model's trained context (config max_position_embeddings) run with the limit raised:
RoPE positions are computed on the fly, so the cost is the real one while the text is not meaningful.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .common import PeakMemory, loglog_fit, summary


def corpus_ids(tokenizer, corpus_path, need: int) -> list[int]:
    from unmask.train.corpus import read_documents

    ids: list[int] = []
    for d in read_documents(corpus_path):
        ids += tokenizer.encode(d.text)
        if len(ids) >= need:
            break
    if not ids:
        raise RuntimeError(f"{corpus_path} has no text")
    while len(ids) < need:
        ids = ids + ids
    return ids[:need]


class CostBench:
    def __init__(self, model, spec, ids: list[int], max_len: int):
        self.model = model
        limit = max(spec.max_context, max_len)
        self.trained_context = spec.max_context
        self.spec = dataclasses.replace(spec, arch=dataclasses.replace(spec.arch, max_position=limit))
        self.ids = ids
        self.mem = PeakMemory()
        self._kv = None

    def _engine(self):
        from unmask.engine.engine import Engine

        return Engine(self.model, self.spec, None, max_num_seqs=1, max_batch_tokens=4096, prefix_cache_bytes=0)

    @staticmethod
    def _params(n: int):
        from unmask.engine.params import GenerationParams

        return GenerationParams(max_tokens=n, ignore_eos=True, policy="topk", tokens_per_step=1)

    def _drive(self, eng, seq) -> dict:
        """Step to completion; split step time into prefill steps (fed > 2 blocks) and decode steps.

        Time per token = decode time / tokens over the decode steps after the first one: the first
        decode step of a request also pays one-off costs (fresh buffers' page faults after the memory
        probe's trim), which a real prefill would absorb and a tiled cache would not."""
        B = seq.B
        pre_s = dec_s = 0.0
        pre_steps = dec_steps = dec_tokens = 0
        first_s = None
        alloc = 0
        while eng.has_unfinished():
            if seq.cache is not None:
                alloc = max(alloc, seq.cache.nbytes())
            fed0, gen0 = eng.stats.tokens_fed, seq.num_generated
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            if eng.stats.tokens_fed - fed0 > 2 * B:
                pre_s += dt
                pre_steps += 1
            elif first_s is None:
                first_s = dt
            else:
                dec_s += dt
                dec_steps += 1
                dec_tokens += seq.num_generated - gen0
        return {"prefill_s": pre_s, "prefill_steps": pre_steps, "first_decode_step_s": first_s,
                "decode_s": dec_s, "decode_steps": dec_steps, "decode_tokens": dec_tokens,
                "kv_alloc_mb": alloc / 2**20,
                "s_per_token": dec_s / dec_tokens if dec_tokens else None}

    @torch.no_grad()
    def prefill_run(self, L: int, gen: int) -> dict:
        eng = self._engine()
        self.mem.start()
        seq = eng.add_request(self.ids[:L], self._params(gen))
        out = self._drive(eng, seq)
        out.update(self.mem.stop())
        out["kv_cache_mb"] = _kv_mb(self.model, L + gen)
        return out

    def _source_kv(self, n: int = 512):
        """K/V of a real n-token block-causal prefill (the tile for `context_run`)."""
        if self._kv is None:
            from unmask.models.attention import AttentionBatch, Segment, commit_cache_lengths

            B = self.spec.block_size
            cache = self.model.new_cache(capacity=n)
            pos = torch.arange(n)
            batch = AttentionBatch([Segment(start=0, length=n, write=n, cache=cache, block_ids=pos // B)]).prepare()
            self.model(torch.tensor(self.ids[:n]), pos, batch)
            commit_cache_lengths(batch)
            self._kv = cache
        return self._kv

    @torch.no_grad()
    def context_run(self, L: int, gen: int) -> dict:
        src = self._source_kv()
        eng = self._engine()
        self.mem.start()
        seq = eng.add_request(self.ids[:L], self._params(gen))
        start = seq.block_start  # the cache holds every full block before the active one
        if seq.traits.shift and start >= seq.B:  # except, for a shifted model, the block before the answer:
            start -= seq.B                       # its last row gives the answer's first token (the engine's rule)
        cache = seq.cache
        for need in range(4096, start, 4096):  # grow the cache as a chunked prefill would (geometrically)
            cache.reserve(need)
        cache.reserve(start)
        n = src.length
        rope = self.model.rope
        cos, sin = rope.cos_sin(torch.arange(n))
        m2 = rope.mscale ** 2
        # keys carry their position (RoPE): undo the source rotation, rotate to the target positions
        plain = [rope.apply(src.k[layer][:, :n].transpose(0, 1), cos / m2, -sin / m2) for layer in range(cache.num_layers)]
        for lo in range(0, start, n):
            hi = min(start, lo + n)
            c, s = rope.cos_sin(torch.arange(lo, hi))
            for layer in range(cache.num_layers):
                cache.k[layer][:, lo:hi] = rope.apply(plain[layer][: hi - lo], c, s).transpose(0, 1)
                cache.v[layer][:, lo:hi] = src.v[layer][:, : hi - lo]
        cache.length = start
        seq.cached = start
        out = self._drive(eng, seq)
        out.update(self.mem.stop())
        out["kv_cache_mb"] = _kv_mb(self.model, L + gen)
        return out

    @torch.no_grad()
    def generate_run(self, G: int, prompt: int = 64) -> dict:
        eng = self._engine()
        self.mem.start()
        seq = eng.add_request(self.ids[:prompt], self._params(G))
        out = self._drive(eng, seq)
        out.update(self.mem.stop())
        out["kv_cache_mb"] = _kv_mb(self.model, prompt + G)
        return out


def _kv_mb(model, tokens: int) -> float:
    c = model.cfg
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * tokens * model.lm_head.weight.element_size() / 2**20


def _interleaved(lengths: list[int], rounds: int, fn, log, what: str) -> dict[int, list[dict]]:
    runs: dict[int, list[dict]] = {L: [] for L in lengths}
    fn(lengths[0])  # warm-up
    for r in range(rounds):
        k = r % len(lengths)
        for L in lengths[k:] + lengths[:k]:
            runs[L].append(fn(L))
        log(f"  cost/{what}: round {r + 1}/{rounds} done")
    return runs


def _curve(runs: dict[int, list[dict]], keys: list[str]) -> dict:
    """Per length: median/min/max over rounds of each key; log-log fits of the medians and of each round."""
    xs = sorted(runs)
    keys = keys + ["delta_mb", "peak_rss_mb"]
    rows = []
    for L in xs:
        row = {"length": L, "kv_cache_mb": runs[L][0]["kv_cache_mb"], "kv_alloc_mb": runs[L][0]["kv_alloc_mb"]}
        for k in keys:
            row[k] = summary([r[k] for r in runs[L] if r.get(k) is not None])
        rows.append(row)
    fits = {}
    n_rounds = min(len(v) for v in runs.values())
    for k in keys[:-1]:
        med = [row[k]["median"] for row in rows]
        fit = loglog_fit(xs, med)
        upper = loglog_fit(xs[len(xs) // 2:], med[len(xs) // 2:]) if len(xs) >= 4 else None
        per_round = [loglog_fit(xs, [runs[L][r].get(k) for L in xs]) for r in range(n_rounds)]
        fits[k] = {"slope": fit[0] if fit else None, "intercept": fit[1] if fit else None,
                   "slope_upper_half": upper[0] if upper else None,
                   "slope_per_round": summary([f[0] for f in per_round if f])}
    return {"rows": rows, "fits": fits}


def run_section(model, spec, tokenizer, corpus_path, cfg: dict, log) -> dict:
    prefill_lengths, context_lengths, gen_lengths = cfg["prefill_lengths"], cfg["context_lengths"], cfg["gen_lengths"]
    dec, rounds = cfg["decode_tokens"], cfg["rounds"]
    need = max(prefill_lengths + context_lengths + [64]) + 8
    bench = CostBench(model, spec, corpus_ids(tokenizer, corpus_path, need),
                      max(prefill_lengths + context_lengths) + dec + 2 * spec.block_size + max(gen_lengths) + 64)
    t0 = time.perf_counter()
    out = {"config": cfg, "trained_context": bench.trained_context, "block_size": spec.block_size}
    runs = _interleaved(prefill_lengths, rounds, lambda L: bench.prefill_run(L, dec), log, "prefill")
    out["prefill"] = _curve(runs, ["prefill_s", "s_per_token"])
    runs = _interleaved(context_lengths, rounds, lambda L: bench.context_run(L, dec), log, "context")
    out["context"] = _curve(runs, ["s_per_token"])
    runs = _interleaved(gen_lengths, rounds, lambda G: bench.generate_run(G), log, "generate")
    out["generate"] = _curve(runs, ["s_per_token"])
    out["seconds"] = time.perf_counter() - t0
    return out


def run_long_prefill(model, spec, tokenizer, corpus_path, cfg: dict, log) -> dict:
    """Real chunked prefills too long for the interleaved suite: `rounds` (default 1) passes over `lengths`."""
    lengths, dec, rounds = cfg["lengths"], cfg["decode_tokens"], cfg["rounds"]
    bench = CostBench(model, spec, corpus_ids(tokenizer, corpus_path, max(lengths) + 8),
                      max(lengths) + dec + 2 * spec.block_size + 64)
    t0 = time.perf_counter()
    bench.prefill_run(1024, dec)  # warm-up at a short length: a 32K warm-up would cost a long run
    runs: dict[int, list[dict]] = {L: [] for L in lengths}
    for r in range(rounds):
        for L in lengths:
            t = time.perf_counter()
            runs[L].append(bench.prefill_run(L, dec))
            log(f"  longprefill: {L:,} tokens in {time.perf_counter() - t:.0f} s (round {r + 1}/{rounds})")
    return {"config": cfg, "trained_context": bench.trained_context, "block_size": spec.block_size,
            "prefill": _curve(runs, ["prefill_s", "s_per_token"]), "seconds": time.perf_counter() - t0}
