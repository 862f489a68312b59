"""Self-speculative decoding: drafts from the diffusion rows, verified by the same forward's next-token rows.

A block-diffusion model whose committed text is read token-causally and trained with a next-token loss
(`causal_context`, the built-in family) is two models in one network: every clean row is an autoregressive
next-token predictor, every masked row a parallel drafter. TiDAR (Liu et al., 2025, arXiv 2511.08923) drafts a
block in diffusion and accepts it autoregressively within one forward; its 1.5B and 8B models reach 7.45 and 8.25
tokens per forward at their AR twins' quality. These are the pure rules of that step; the layout of the forward
is `unmask.engine.speculative`.

The rule is lossless: greedy, the output is exactly what the next-token rows would write one token per forward;
sampling, each output token is distributed exactly as the next-token rows' processed distribution
(speculative sampling: Leviathan et al. 2023, Chen et al. 2023): a draft d drawn from q is kept with probability
min(1, p(d) / q(d)); the first one refused is replaced by a draw from max(p - q, 0), renormalised.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from unmask.decoding.sampling import SamplingParams, _multinomial, _top_p_filter, row_argmax


@dataclass
class Verdict:
    accepted: int      # leading drafts kept
    tokens: Tensor     # [accepted + 1] long: the kept drafts, then the verifier's own token after them


def processed_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[M, V] float32: the distribution a token is drawn from after temperature, top-k, then top-p (the order of
    `sampling.propose`); greedy: one-hot at the argmax, so speculative sampling reduces to exact matching."""
    x = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    work = x / params.temperature if params.temperature != 1 else x
    if 0 < params.top_k < work.shape[1]:
        kth = work.topk(params.top_k, dim=-1).values[:, -1:]
        work = work.masked_fill(work < kth, float("-inf"))
    if params.top_p < 1:
        sorted_, order = work.sort(dim=-1, descending=True)
        work = torch.full_like(work, float("-inf")).scatter(1, order, _top_p_filter(sorted_, params.top_p))
    return torch.softmax(work, dim=-1)


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """[M] long: one token per row of a processed distribution (greedy rows are one-hot: their argmax)."""
    return _multinomial(probs, generator) if probs.shape[0] else torch.empty(0, dtype=torch.long)


def verify(drafts: Tensor, draft_probs: Tensor | None, target_probs: Tensor, greedy: bool,
           generator: torch.Generator | None) -> Verdict:
    """Accept a prefix of `drafts` [k] against the verifier's distributions `target_probs` [k + 1, V] (row i is the
    distribution of the token at the position of drafts[i]; row k the one after the last draft; greedy: any rows
    with the verifier's argmax, its logits too).

    Greedy: drafts are kept while they equal the verifier's argmax; then the argmax at the first difference (or
    after the last draft) is appended. Sampling: `draft_probs` [k, V] are the distributions the drafts were drawn
    from; draft i is kept with probability min(1, p_i(d) / q_i(d)); at the first refusal the token is drawn from
    max(p_i - q_i, 0) renormalised; if all are kept, the next token is drawn from p_k."""
    k = int(drafts.numel())
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"verify needs {k + 1} verifier rows for {k} drafts, got {target_probs.shape[0]}")
    p = target_probs.float()
    if greedy:
        best = row_argmax(p)
        same = (best[:k] == drafts).long()
        accepted = int(same.cumprod(0).sum()) if k else 0
        tokens = torch.cat([drafts[:accepted], best[accepted:accepted + 1]])
        return Verdict(accepted, tokens)
    if k == 0:
        return Verdict(0, draw(p[:1], generator))
    if draft_probs is None or draft_probs.shape[0] != k:
        raise ValueError("speculative sampling needs the distribution each draft was drawn from")
    q = draft_probs.float()
    idx = torch.arange(k)
    pd, qd = p[idx, drafts], q[idx, drafts]
    u = torch.rand(k, generator=generator, device=generator.device if generator is not None else "cpu").to(p.device)
    keep = u * qd <= pd  # u < p/q without dividing by a q of 0
    accepted = int(keep.long().cumprod(0).sum()) if k else 0
    if accepted < k:
        residual = (p[accepted] - q[accepted]).clamp_min(0)
        total = residual.sum()
        # p == q on the support: the refusal had probability 0 (rounding); p itself is then the right law
        row = residual / total if float(total) > 0 else p[accepted]
    else:
        row = p[k]
    last = draw(row[None], generator)
    tokens = torch.cat([drafts[:accepted], last])
    return Verdict(accepted, tokens)


def lookup_drafts(ids: Tensor, max_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> Tensor:
    """[<= max_tokens] long: prompt-lookup drafts (Saxena 2023; vLLM's `ngram` method, llama.cpp's lookup decoding).

    The longest suffix of `ids` (max_ngram down to min_ngram tokens) that also occurs earlier in `ids` is
    looked up at its latest earlier occurrence, and the tokens that followed it there are the drafts; where they run into the end
    of `ids`, the match implies a period (the text since the occurrence repeats), which the drafts continue. Empty when nothing matches. Free of
    model compute: a draft costs only its verifier row, and a wrong one only that row."""
    n_ids = int(ids.numel())
    if max_tokens <= 0 or n_ids < 2:
        return ids[:0]
    text = ids.detach().cpu().numpy()
    for n, ends in match_ends(text, min(max_ngram, n_ids - 1), min_ngram):
        if ends.size:
            start = int(ends[-1]) + 1
            copied = ids[start:start + max_tokens]
            if copied.numel() < max_tokens:  # ran into the end: the match implies a period, continue it
                period = n_ids - start
                copied = copied.repeat(-(-max_tokens // period))[:max_tokens]
            return copied
    return ids[:0]


def match_ends(text: np.ndarray, top: int, bottom: int):
    """(n, ascending end positions of the earlier windows equal to the last n tokens of `text`), for n from top down
    to bottom, in one pass: the positions matching the last token, then narrowed one token back per n. NumPy on
    the host: the same search through torch's small ops took 30 us over a ~300-token prompt, and it runs once or
    twice a step."""
    n_ids = int(text.size)
    ends = np.flatnonzero(text[:n_ids - 1] == text[n_ids - 1])
    by_n = {1: ends}
    for n in range(2, top + 1):
        ends = ends[ends >= n - 1]
        ends = ends[text[ends - (n - 1)] == text[n_ids - n]]
        by_n[n] = ends
    for n in range(top, bottom - 1, -1):
        yield n, by_n[n]
