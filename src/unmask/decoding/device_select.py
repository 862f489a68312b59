"""The threshold and top-k commit rules over a whole batch at once, as tensor ops only (no host reads).

`policies.threshold` and `policies.topk` decide one request's [M] rows on the host; the static decode step
(unmask.engine.static_step) runs the same rules inside its captured forward, over [rows, K] proposals of every
request of the step, so that a greedy step's decision needs no host round trip. These functions are the
batched form of `policies.threshold_mask` and `policies.top_rows` (with `clamp_count`), and are tested equal to
them row by row (tests/test_device_select.py): the single-request functions stay the definition of the rules.

Padding columns (a request reads fewer than K rows) are `valid == False`: never committed, never the most
confident row, never counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import Proposal

HOST, THRESHOLD, TOPK = 0, 1, 2  # rule codes per row: HOST = the request's rule runs on the host instead

# the policies whose rule this module computes, by PolicyConfig.name
DEVICE_RULES = {"threshold": THRESHOLD, "topk": TOPK}


@dataclass
class DeviceDecision(Proposal):
    """A greedy proposal with its rule's commit mask, both made on the device (`policies.decide` takes the mask
    instead of running the rule again)."""

    commit: Tensor  # bool [M]


def rule_code(name: str) -> int:
    return DEVICE_RULES.get(name, HOST)


def threshold_rows(conf: Tensor, valid: Tensor, tau: Tensor) -> Tensor:
    """Bool [R, K]: conf >= tau[r], plus each row's single most confident valid column (the first one on ties,
    as `threshold_mask`'s argmax). conf float32 [R, K]; tau float32 [R] (the comparison is in float32, as the
    host's `conf >= tau` with a Python float is)."""
    conf = conf.masked_fill(~valid, float("-inf"))
    commit = conf >= tau[:, None]
    commit.scatter_(1, conf.argmax(dim=1, keepdim=True), True)
    return commit & valid


def top_n_rows(conf: Tensor, valid: Tensor, n: Tensor) -> Tensor:
    """Bool [R, K]: each row's n[r] highest valid `conf`, ties to the lower column (a stable sort, as `top_rows`);
    n is clamped to [1, valid count] (`clamp_count`)."""
    k = conf.shape[1]
    conf = conf.masked_fill(~valid, float("-inf"))
    order = torch.sort(conf, dim=1, descending=True, stable=True).indices
    columns = torch.arange(k, device=conf.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, columns)       # rank[r, c]: place of column c in row r's order
    quota = torch.minimum(n.clamp(min=1), valid.sum(dim=1))
    return (rank < quota[:, None]) & valid


def commit_rows(probs: Tensor, valid: Tensor, rule: Tensor, tau: Tensor, n: Tensor, first: Tensor) -> Tensor:
    """The commit mask of every row of a step: `threshold_rows` where rule == THRESHOLD, `top_n_rows` (n =
    tokens_per_step) where rule == TOPK, nothing where HOST; `first` forces column 0 (the block's first token of
    a family that writes it autoregressively, `Sequence._choose`). probs [R, K] float32; valid [R, K] bool;
    rule, n [R] long; tau [R] float32; first [R] bool."""
    thr = threshold_rows(probs, valid, tau)
    top = top_n_rows(probs, valid, n)
    commit = torch.where((rule == THRESHOLD)[:, None], thr, top & (rule == TOPK)[:, None])
    commit[:, 0] |= first & (rule != HOST) & valid[:, 0]
    return commit
