"""A draft adapter: low-rank weights that act only on the rows whose input token is the mask.

Under self-speculative decoding (decoding.speculative) the committed text's rows are the verifier and the masked
rows the drafter. Training the whole network to draft better also moves the verifier, and so the output: the
drafters distilled so far gained tokens per forward and lost held-out quality with it (docs/training.md). An
adapter gated by the row's input keeps every clean row's computation exactly the base model's (its delta is
selected away, not added as zeros), while masked rows get W x + B A x * alpha / r (LoRA's form, arXiv
2106.09685, here applied per row). Clean rows never attend to masked ones in the block-causal layouts the
verifier reads (committed text and drafts are token-causal over themselves), so speculative decoding with the
adapter writes exactly what the base model's next-token decoding writes, in fewer forwards when the drafts
improve. Diffusion policies (threshold, ...) read masked rows too, so their output does change.

The gate is computed once per forward from the input ids (`DraftGate.set`), so every path (ragged batches,
static graph-captured steps, dense training) gets it without passing anything new through the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unmask.errors import ModelLoadError
from unmask.models.cpu_linear import PackedLinear, packed_forward

DRAFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DraftAdapterConfig:
    rank: int
    alpha: float
    mask_id: int
    targets: tuple[str, ...] = DRAFT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_config(self) -> dict:
        """The `draft_adapter` entry of config.json."""
        return {"rank": self.rank, "alpha": self.alpha, "mask_token_id": self.mask_id,
                "target_modules": list(self.targets)}

    @classmethod
    def from_config(cls, entry) -> "DraftAdapterConfig | None":
        """From config.json's `draft_adapter` (None or absent: no adapter); a malformed entry is a load error."""
        if entry is None:
            return None
        if not isinstance(entry, dict):
            raise ModelLoadError(f"config.json draft_adapter must be an object, got {type(entry).__name__}")
        rank, alpha, mask = entry.get("rank"), entry.get("alpha"), entry.get("mask_token_id")
        targets = tuple(entry.get("target_modules") or DRAFT_TARGETS)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ModelLoadError(f"config.json draft_adapter.rank must be a positive integer, got {rank!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
            raise ModelLoadError(f"config.json draft_adapter.alpha must be a positive number, got {alpha!r}")
        if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
            raise ModelLoadError(f"config.json draft_adapter.mask_token_id must be a token id, got {mask!r}")
        unknown = sorted(set(targets) - set(DRAFT_TARGETS))
        if unknown:
            raise ModelLoadError(f"config.json draft_adapter.target_modules: unknown {', '.join(unknown)} "
                                 f"(choose from {', '.join(DRAFT_TARGETS)})")
        return cls(rank, float(alpha), mask, targets)


class DraftGate:
    """Which rows of the current forward are draft rows: [..., 1] bool, shaped like the activations' lead dims."""

    def __init__(self, mask_id: int):
        self.mask_id = mask_id
        self.rows: Tensor | None = None
        self.index: Tensor | None = None  # CPU inference: the flat indices of the draft rows (None: use `rows`)

    def set(self, ids: Tensor) -> None:
        rows = ids == self.mask_id
        self.rows, self.index = rows.unsqueeze(-1), None
        if not ids.is_cuda and not torch.is_grad_enabled():
            # on the CPU a forward can afford the look: a prefill chunk has no draft rows (no adapter FLOPs at
            # all), a speculative step ~16 of ~20; on CUDA the selection stays on the device (graph-safe)
            self.index = rows.reshape(-1).nonzero().squeeze(1)


class DraftLinear(nn.Linear):
    """nn.Linear (same parameter names, so base checkpoints load unchanged) plus `draft_a` [r, in] and `draft_b`
    [out, r], applied where the gate says the row is a draft row."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, scale: float, gate: DraftGate,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.draft_a = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.draft_b = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.draft_a, a=math.sqrt(5))  # LoRA's init: A random, B zero (a no-op at start)
        self.scale = scale
        self.gate = gate

    follows_packing = True  # cpu_linear.pack_linears: the base product takes the packed path when the model's does
    packed = False

    def forward(self, x: Tensor) -> Tensor:
        y = packed_forward(self, x) if self.packed else F.linear(x, self.weight, self.bias)
        rows, index = self.gate.rows, self.gate.index
        if rows is None:
            return y
        if index is not None:  # only the draft rows, gathered; the others are the base's y untouched
            if index.numel():
                flat, lead = x.reshape(-1, x.shape[-1]), y.shape
                y = y.reshape(-1, y.shape[-1])
                y[index] += F.linear(F.linear(flat[index], self.draft_a), self.draft_b) * self.scale
                y = y.reshape(lead)
            return y
        delta = F.linear(F.linear(x, self.draft_a), self.draft_b)
        # where, not y + delta * rows: a clean row is the base's y bit for bit
        return torch.where(rows, y + delta * self.scale, y)


def add_draft_adapter(model: nn.Module, cfg: DraftAdapterConfig, gate: DraftGate) -> None:
    """Swap every targeted nn.Linear of `model` for a DraftLinear sharing its weight and bias (B = 0: the model
    computes what it did until the adapter trains)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in cfg.targets and type(child) in (nn.Linear, PackedLinear):
                w = child.weight
                new = DraftLinear(child.in_features, child.out_features, child.bias is not None, cfg.rank,
                                  cfg.scale, gate, device=w.device, dtype=w.dtype)
                new.weight, new.bias = child.weight, child.bias
                setattr(parent, name, new)
