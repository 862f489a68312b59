"""The static step's sampler as it was before it went sort-free (decoding/device_sample.py at 9039019): a stable
descending sort of every row, top-k and top-p over the sorted columns, the draw by inverting the CDF in sorted
order. Kept only as the reference that tests/test_device_sample.py compares the sort-free selection with, and as
the "before" of bench/device_sample.py; nothing in src/ uses it."""
from __future__ import annotations

import torch
from torch import Tensor

from unmask.decoding.sampling import Proposal


def sorted_filter(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """(work, ids) [N, V]: logits / temperature sorted descending (stable: ties by lowest index) with -inf on the
    columns top-k and then top-p drop, and the vocabulary id of each column."""
    v = logits.shape[1]
    work, ids = (logits / temperature[:, None]).sort(dim=-1, descending=True, stable=True)
    cols = torch.arange(v, device=logits.device)
    keep = torch.where(top_k > 0, top_k, v)
    work = work.masked_fill(cols[None, :] >= keep[:, None], float("-inf"))
    probs = torch.softmax(work, dim=-1)
    # the token whose preceding mass already reaches top_p goes, the top-1 never (sampling._top_p_filter); rows
    # without top-p skip it (a rounded cumulative sum can reach 1.0 before the tail)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False
    return work.masked_fill(drop, float("-inf")), ids


def sorted_kept(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """bool [N, V] in vocabulary order: the tokens the sort-based rule leaves a finite logit."""
    work, ids = sorted_filter(logits, temperature, top_k, top_p)
    return torch.zeros_like(work, dtype=torch.bool).scatter(1, ids, work > float("-inf"))


def sorted_sample_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Proposal:
    """The old `sample_rows`: one draw per row, inverting the CDF of the sorted columns with the row's uniform."""
    n, v = logits.shape
    work, ids = sorted_filter(logits, temperature, top_k, top_p)
    lse = torch.logsumexp(work, dim=-1)
    probs = (work - lse[:, None]).exp()
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1].double()).float()
    choice = (cdf < target[:, None]).sum(dim=-1).clamp(max=v - 1)
    col = choice[:, None]
    margin = probs[:, 0] - probs[:, 1] if v > 1 else probs[:, 0]  # sorted: the two most likely
    return Proposal(tokens=ids.gather(1, col).squeeze(1), probs=probs.gather(1, col).squeeze(1),
                    entropy=torch.full((n,), float("nan"), device=logits.device), margin=margin,
                    logprobs=work.gather(1, col).squeeze(1) - lse)
