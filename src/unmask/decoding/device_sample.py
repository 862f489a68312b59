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

The processed distribution is `propose`'s: logits / temperature, then the top_k largest (ties by lowest index,
as a stable sort orders them), then the smallest prefix of the survivors sorted descending with mass >= top_p
(top_k = 0 and top_p = 1: off). Nothing is sorted, though: a [N, 152K] sort per step needs its values, int64
indices and the sort's scratch on the device. The two thresholds are found by a fixed 32-round bisection over
the values' integer keys (one count or masked sum over V a round), and the token is drawn by inverting the
cumulative sum in vocabulary order with the row's uniform. The same uniform therefore picks another token
than the earlier sorted-order inversion did; the distribution is the same.
"""
from __future__ import annotations

from dataclasses import fields

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


# Sort-free selection. FlashInfer's sampling kernels avoid the sort by rejection sampling around pivots and vLLM's
# Triton top-k/top-p (after Qrita, Park et al. 2026) searches a pivot until it holds; both loop a data-dependent
# number of times inside one kernel. With stock tensor ops inside a CUDA graph the loop count must be fixed, so the
# thresholds here are found by binary lifting over the 2^32 order-preserving integer keys of float32: 32 rounds,
# each one count (or masked sum) over V, whatever the values.
INT32_MIN = -(1 << 31)


def ordered_keys(x: Tensor) -> Tensor:
    """int32 keys of float32 x (consumed: its memory becomes the keys), ordered as the values: the bit pattern
    with the magnitude bits of negative values flipped. -0.0 becomes +0.0 first: they compare equal, so a sort
    keeps them in index order, and so must the keys."""
    bits = x.add_(0.0).view(torch.int32)
    return bits.bitwise_xor_((bits >> 31).bitwise_and_(0x7FFFFFFF))


def lift_largest(n: int, device: torch.device, holds) -> Tensor:
    """int32 [N]: the largest key t of each row for which holds(t) (monotone: true below some key, false above) is
    true, setting the bits of t - INT32_MIN from the top; INT32_MIN where it holds nowhere above it."""
    ans = torch.full((n,), INT32_MIN, dtype=torch.int32, device=device)
    for bit in range(31, -1, -1):
        cand = torch.zeros_like(ans) if bit == 31 else ans | (1 << bit)  # ans + 2^bit (the bits below are 0)
        ans = torch.where(holds(cand[:, None]), cand, ans)
    return ans


def count(mask: Tensor) -> Tensor:
    """int32 [N]: the true entries of each row of mask. Summing bool makes torch copy the mask to the sum's dtype
    first (int64 by default: 8 bytes a token); int32 halves that temporary."""
    return mask.sum(dim=-1, dtype=torch.int32)


def top_k_keep(keys: Tensor, top_k: Tensor) -> Tensor:
    """bool [N, V]: the top_k[r] largest of each row of keys (0: all), ties at the k-th value kept by lowest index,
    as a stable descending sort's first k columns are: exactly k survive."""
    v = keys.shape[1]
    k = torch.where(top_k > 0, top_k, v).clamp(max=v).to(torch.int32)
    t = lift_largest(keys.shape[0], keys.device, lambda c: count(keys >= c) >= k)[:, None]  # the k-th largest
    above, tie = keys > t, keys == t
    room = (k - count(above))[:, None]  # how many of the tied values still fit
    return above | (tie & (tie.to(torch.int32).cumsum_(dim=-1) <= room))


def top_p_keep(keys: Tensor, probs: Tensor, top_p: Tensor) -> Tensor:
    """bool [N, V]: `sampling._top_p_filter`'s survivors without the sort (probs is consumed: overwritten). In
    the stable descending order a token goes when the mass before it reaches top_p, the top-1 never. That mass is
    the mass strictly above its value plus its tied predecessors' (lower indices). With t the smallest key whose
    mass above is < top_p (one past the largest whose mass above is >= top_p): keys above t stay, keys below go
    (the mass above them is >= top_p), and the tokens at t stay while the mass before them is < top_p. top_p <= 0
    acts as the smallest positive float (the same survivors: only the top-1). Rows with top_p >= 1 keep
    everything (a rounded cumulative sum can reach 1.0 before the tail)."""
    p = top_p.clamp(min=torch.finfo(torch.float32).tiny)

    def mass_above_reaches_p(c: Tensor) -> Tensor:
        return torch.where(keys > c, probs, 0.0).sum(dim=-1) >= p

    # one past the last key whose mass above reaches p: at most key(+inf), as the mass above +inf is 0 < p
    t = (lift_largest(keys.shape[0], keys.device, mass_above_reaches_p) + 1)[:, None]
    above, tie = keys > t, keys == t
    mass_above = torch.where(above, probs, 0.0).sum(dim=-1, keepdim=True)
    # tied tokens have the same probability, so the mass before the i-th is mass_above + (i + 1) p_t - p_t
    p_t = probs.gather(1, tie.byte().argmax(dim=-1, keepdim=True))
    before = probs.masked_fill_(~tie, 0.0).cumsum_(dim=-1).sub_(p_t).add_(mass_above)  # in probs' memory
    keep = tie.logical_and_(before < p[:, None]).logical_or_(above)
    del before, above  # the [N, V] temporaries go before the next ones come
    cols = torch.arange(keys.shape[1], device=keys.device)
    keep |= cols[None, :] == keys.argmax(dim=-1, keepdim=True)  # the first maximum: the stable sort's top-1
    return keep.logical_or_((top_p >= 1)[:, None])


def filtered(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """[N, V]: logits / temperature with -inf on every token top-k and then top-p drop (the processed logits).
    What it holds at once stays near three [N, V] float32 arrays (the keys, the probabilities, one temporary) and
    a few bool masks: the keys take the memory of logits / temperature, which is recomputed when needed, and the
    probabilities become top-p's cumulative sums."""
    keys = ordered_keys(logits / temperature[:, None])
    keep = top_k_keep(keys, top_k)
    probs = torch.softmax((logits / temperature[:, None]).masked_fill_(~keep, float("-inf")), dim=-1)
    keep &= top_p_keep(keys, probs, top_p)
    del keys, probs
    return (logits / temperature[:, None]).masked_fill_(~keep, float("-inf"))


# Rows per slice: sample_rows works through the rows this many at a time, so its temporaries (about 3.75x a
# slice's float32 logits at the peak) are bounded by the slice, not by rows x K. A static loop: its count depends on
# the shape only. On this CPU 16-row slices of a 152K vocabulary ran 64 rows in less than half the time of one
# 64-row slice (bench/device_sample.py, `sort_free_one_slice`); on a GPU a larger slice means fewer launches per
# row, and 64 rows there is a guess (unmeasured).
SLICE_ROWS_CPU, SLICE_ROWS_GPU = 16, 64


def sample_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Proposal:
    """One draw per row of logits [N, V] (float32, no NaN) under each row's temperature (> 0) [N], top_k [N] long
    (0: off), top_p [N] float (1: off), with its uniform u [N] float64. A fixed sequence of tensor ops (no sort,
    no host read, no value-dependent Python): it runs inside CUDA graph capture. Entropy is not computed (NaN):
    the rules the static step runs on the device need none."""
    step = SLICE_ROWS_CPU if logits.device.type == "cpu" else SLICE_ROWS_GPU
    parts = [sample_slice(logits[i:i + step], temperature[i:i + step], top_k[i:i + step], top_p[i:i + step],
                          u[i:i + step]) for i in range(0, max(logits.shape[0], 1), step)]  # 0 rows: one
    if len(parts) == 1:
        return parts[0]
    return Proposal(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Proposal)))


def sample_slice(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Proposal:
    """`sample_rows` over one slice of rows."""
    n, v = logits.shape
    work = filtered(logits, temperature, top_k, top_p)
    lse = torch.logsumexp(work, dim=-1, keepdim=True)
    # invert the cumulative sum in index order: the first column whose cumulative mass reaches u x total. A token
    # of probability 0 adds nothing to the sum, so it is never that column; u < 1 keeps the target <= the total
    cdf = (work - lse).exp_().cumsum_(dim=-1)
    target = (u * cdf[:, -1].double()).float()
    choice = count(cdf < target[:, None]).long().clamp(max=v - 1)
    del cdf
    logprobs = work.gather(1, choice[:, None]) - lse
    top2 = (work.topk(min(2, v), dim=-1).values - lse).exp()
    margin = top2[:, 0] - top2[:, 1] if v > 1 else top2[:, 0]
    return Proposal(tokens=choice, probs=logprobs.exp().squeeze(1),
                    entropy=torch.full((n,), float("nan"), device=logits.device), margin=margin,
                    logprobs=logprobs.squeeze(1))
