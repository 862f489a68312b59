"""Token proposals for still-masked positions: one candidate token per row plus the confidences policies need.

`propose` is a pure tensor function: logits in, a `Proposal` out; no model, no request objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def row_argmax(x: Tensor) -> Tensor:
    """x.argmax(-1), the first maximum of each row (NaN counts as the maximum, as torch's), through NumPy for CPU
    float32 rows: torch 2.13's CPU argmax took 64 us for 10 rows of 8,192 logits, NumPy's 5.5 us (2-core Xeon,
    2026-12-06, `python -m timeit` in docs/benchmarks.md), and a self-speculative step takes two or three of them."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() > 0 and x.shape[-1] and not x.requires_grad:
        return torch.from_numpy(np.asarray(x.numpy().argmax(-1), dtype=np.int64))  # a 1-D x: a 0-D result
    return x.argmax(dim=-1)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings."""

    temperature: float = 0.0  # 0 = greedy (argmax); top_k / top_p are then ignored unless greedy_filters
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest prefix of the sorted distribution with mass >= top_p; 1 = off
    # greedy only: confidences (p, entropy, margin) come from the top_p- then top_k-filtered softmax, as Dream's
    # sample_tokens computes them at temperature 0; the argmax itself is the same either way
    greedy_filters: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Proposal:
    """Candidate token per row and statistics of the processed distribution it came from (all [M])."""

    tokens: Tensor  # long: proposed token x0
    probs: Tensor  # float32: p(x0) under the processed distribution (greedy: softmax max)
    entropy: Tensor  # float32: entropy of the processed distribution, in nats
    margin: Tensor  # float32: p1 - p2 of the processed distribution
    logprobs: Tensor  # float32: log p(x0), computed in log space (no underflow to -inf)


def propose(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None,
            need_entropy: bool = True) -> Proposal:
    """Propose one token per row of `logits` [M, V].

    Steps:
      1. Cast to float32 (no copy when already float32).
      2. Greedy (temperature 0): x0 = argmax(logits); statistics of softmax(logits). top-k/top-p cannot change
         the argmax and are ignored, so confidences are those of the full softmax (as LLaDA, Fast-dLLM and LLaDA2 do);
         with `greedy_filters` they come from the top_p- then top_k-filtered softmax instead (as Dream does).
      3. Otherwise divide by the temperature, then top-k (only the k largest logits survive, kept as a [M, k]
         slice), then top-p over the survivors (sorted descending; smallest prefix with mass >= top_p).
         Order top-k -> top-p as in SDAR and vLLM (Dream applies top-p first; results differ only at edges).
      4. Sample x0 ~ processed distribution by inverse CDF, one uniform per row from `generator` (`_multinomial`):
         rows of one call are drawn in order from that generator only, so a request's draws never depend on other
         requests.
      5. Report p(x0), log p(x0), entropy and p1 - p2 of the processed distribution.
    Greedy without `need_entropy` never materialises the softmax: max, top-2 and logsumexp suffice
    (the per-step cost that matters with 150K-token vocabularies); entropy is then NaN.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, V], got shape {tuple(logits.shape)}")
    x = logits.float()
    if x.shape[0] == 0:
        return _empty(x)

    if params.greedy and params.greedy_filters and (params.top_k > 0 or params.top_p < 1):
        return _greedy_filtered(x, params)

    if params.greedy and not need_entropy:
        top2, top2_ids = x.topk(min(2, x.shape[1]), dim=-1)
        lse = torch.logsumexp(x, dim=-1)
        p2 = (top2 - lse.unsqueeze(1)).exp()
        margin = p2[:, 0] - p2[:, 1] if p2.shape[1] > 1 else p2[:, 0]
        return Proposal(tokens=top2_ids[:, 0], probs=p2[:, 0], entropy=torch.full_like(lse, float("nan")),
                        margin=margin, logprobs=top2[:, 0] - lse)

    ids: Tensor | None = None  # maps a column of `work` back to a vocabulary id (None = identity)
    sorted_desc = False
    if params.greedy:
        work = x
        choice = row_argmax(x)  # on logits, like the references' argmax
    else:
        work = x / params.temperature if params.temperature != 1 else x
        if 0 < params.top_k < work.shape[1]:
            work, ids = work.topk(params.top_k, dim=-1)  # sorted descending; the rest of the vocab is dropped
            sorted_desc = True
        if params.top_p < 1:
            if not sorted_desc:
                work, ids = work.sort(dim=-1, descending=True)
                sorted_desc = True
            work = _top_p_filter(work, params.top_p)
        choice = None

    probs, lse = _softmax_with_lse(work)
    if choice is None:
        choice = _multinomial(probs, generator)

    col = choice.unsqueeze(1)
    tokens = choice if ids is None else ids.gather(1, col).squeeze(1)
    p_tok = probs.gather(1, col).squeeze(1)
    logp_tok = work.gather(1, col).squeeze(1) - lse
    entropy = torch.special.entr(probs).sum(dim=-1)  # entr(0) = 0, so filtered tokens contribute nothing
    top2 = probs[:, :2] if sorted_desc else probs.topk(min(2, probs.shape[1]), dim=-1).values
    margin = top2[:, 0] - top2[:, 1] if top2.shape[1] > 1 else top2[:, 0]
    return Proposal(tokens=tokens, probs=p_tok, entropy=entropy, margin=margin, logprobs=logp_tok)


def _greedy_filtered(x: Tensor, params: SamplingParams) -> Proposal:
    """Greedy proposal whose statistics come from the filtered distribution (Dream's `sample_tokens` at T = 0).

    1. top_p (when < 1) over the sorted distribution: a token is dropped when the mass strictly before it
       already exceeds top_p (the top-1 always stays).
    2. top_k (when > 0) over what is left: tokens below the k-th largest surviving logit are dropped.
    3. x0 = argmax (unchanged by 1-2); p(x0), entropy and p1 - p2 of the softmax over the survivors.
    """
    work = x.sort(dim=-1, descending=True).values
    if params.top_p < 1:
        probs = torch.softmax(work, dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p
        drop[:, 0] = False
        work = work.masked_fill(drop, float("-inf"))
    if 0 < params.top_k < work.shape[1]:
        work = work.masked_fill(work < work[:, params.top_k - 1:params.top_k], float("-inf"))
    probs, lse = _softmax_with_lse(work)
    margin = probs[:, 0] - probs[:, 1] if probs.shape[1] > 1 else probs[:, 0]
    return Proposal(tokens=row_argmax(x), probs=probs[:, 0], entropy=torch.special.entr(probs).sum(dim=-1),
                    margin=margin, logprobs=work[:, 0] - lse)


def _softmax_with_lse(x: Tensor) -> tuple[Tensor, Tensor]:
    """Row softmax of x and its log-normaliser [M]; -inf entries get probability 0."""
    lse = torch.logsumexp(x, dim=-1)
    return (x - lse.unsqueeze(1)).exp_(), lse


def _top_p_filter(sorted_logits: Tensor, top_p: float) -> Tensor:
    """-inf for every token whose preceding mass (sorted descending) already reaches top_p; the top-1 always stays."""
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, float("-inf"))


def _multinomial(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row [M] long, by inverse CDF: row i takes the first token whose cumulative probability
    exceeds the i-th of M uniforms (scaled by the row's total, so rounding in the sum never runs off the end and a
    zero-probability token is never taken). One uniform per row instead of one random number per vocabulary entry:
    `torch.multinomial` (an exponential per entry) took 354 ms for [96, 151,936] on one CPU thread, this 42 ms
    (scratch timing, 2026-12-06), the step cost of sampling a bidirectional canvas over a Qwen vocabulary."""
    gen_device = generator.device if generator is not None else probs.device
    cdf = probs.float().cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=gen_device).to(probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_max_(probs.shape[1] - 1).squeeze(1)


def _empty(x: Tensor) -> Proposal:
    f = x.new_empty(0)
    return Proposal(tokens=torch.empty(0, dtype=torch.long, device=x.device), probs=f, entropy=f.clone(),
                    margin=f.clone(), logprobs=f.clone())


def top_logprobs(rows: Tensor, k: int, temperature: float = 0.0) -> tuple[Tensor, Tensor]:
    """(ids [M, k], log-probabilities [M, k]) of the k most likely tokens of each row of logits [M, V].

    The distribution is the one the token was drawn from before truncation: softmax(logits / T) when
    sampling, softmax(logits) when greedy; top-k / top-p are not applied, so the alternatives a truncated
    sampler could not pick still show with their probability (as OpenAI's alternatives do)."""
    x = rows.float()
    if temperature > 0:
        x = x / temperature
    values, ids = torch.log_softmax(x, dim=-1).topk(min(k, x.shape[-1]), dim=-1)
    return ids, values
