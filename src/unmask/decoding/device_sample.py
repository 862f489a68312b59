"""Sampling inside the static decode step: temperature, top-k and top-p per row, as tensor ops only.

`sampling.propose` samples one request's rows on the host with `torch.multinomial` and the request's
`torch.Generator`. A captured step cannot call a host generator, and one device generator shared by the
batch would make a request's draws depend on which other requests ran beside it. So the static step
(unmask.engine.static_step) draws its uniforms from a counter-based generator instead (the idea of
Philox / "Parallel random numbers: as easy as 1, 2, 3", Salmon et al., SC 2011; here SplitMix64's mixing
function, Steele et al., OOPSLA 2014): the uniform of read row j of a request at its draw `counter` is a hash
of (seed, counter, j). It needs no state on the device, is the same alone or batched, and a seeded request
draws the same tokens on every run. They are not the host path's draws (another generator), so a seeded
request's sampled tokens differ between the static step with device sampling and the eager path; the
distribution each token is drawn from is the same (tests/test_device_sample.py compares counts).

The processed distribution is `propose`'s: logits / temperature, then the top_k largest, then the smallest
prefix of the sorted survivors with mass >= top_p (top_k = 0 and top_p = 1: off); the token is drawn by
inverting the cumulative sum with the row's uniform.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .sampling import Proposal

_M64 = 1 << 64


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch holds it (two's complement)."""
    return c - _M64 if c >= 1 << 63 else c


GOLDEN = _signed(0x9E3779B97F4A7C15)  # SplitMix64's increment (2^64 / golden ratio)
MIX1 = _signed(0xBF58476D1CE4E5B9)
MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """SplitMix64's output function over int64 [...] (multiplications wrap modulo 2^64, as int64 ops do)."""
    x = x + GOLDEN
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def uniforms(seed: Tensor, counter: Tensor, k: int) -> Tensor:
    """float64 [R, k] in (0, 1): the uniform of column j of row r at its draw counter[r], for seed[r]."""
    cols = torch.arange(k, device=seed.device)
    h = splitmix64(splitmix64(seed)[:, None] ^ (counter[:, None] * GOLDEN + cols[None, :]))
    return (_shr(h, 11).double() + 0.5) * 2.0 ** -53


def sample_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Proposal:
    """One draw per row of logits [N, V] (float32) under each row's temperature (> 0) [N], top_k [N] long (0: off),
    top_p [N] float (1: off), with its uniform u [N] float64. Entropy is not computed (NaN): the rules the
    static step runs on the device need none."""
    n, v = logits.shape
    work, ids = (logits / temperature[:, None]).sort(dim=-1, descending=True, stable=True)
    cols = torch.arange(v, device=logits.device)
    keep = torch.where(top_k > 0, top_k, v)
    work = work.masked_fill(cols[None, :] >= keep[:, None], float("-inf"))
    probs = torch.softmax(work, dim=-1)
    # the token whose preceding mass already reaches top_p goes, the top-1 never (sampling._top_p_filter); rows
    # without top-p skip it (a rounded cumulative sum can reach 1.0 before the tail)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False
    work = work.masked_fill(drop, float("-inf"))
    lse = torch.logsumexp(work, dim=-1)
    probs = (work - lse[:, None]).exp()
    cdf = probs.cumsum(dim=-1)
    # the first column whose cumulative mass reaches u x total: a token of probability 0 adds nothing to the
    # sum, so it is never that column; u < 1 keeps the target at or below the total
    target = (u * cdf[:, -1].double()).float()
    choice = (cdf < target[:, None]).sum(dim=-1).clamp(max=v - 1)
    col = choice[:, None]
    margin = probs[:, 0] - probs[:, 1] if v > 1 else probs[:, 0]  # sorted: the two most likely
    return Proposal(tokens=ids.gather(1, col).squeeze(1), probs=probs.gather(1, col).squeeze(1),
                    entropy=torch.full((n,), float("nan"), device=logits.device), margin=margin,
                    logprobs=work.gather(1, col).squeeze(1) - lse)
