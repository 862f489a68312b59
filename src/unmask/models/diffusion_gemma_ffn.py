"""The feed-forward half of a DiffusionGemma layer: the dense GeGLU MLP and, in parallel, the routed mixture of
experts (router + fused expert weights, grouped GEMM where the torch build has it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unmask.models.diffusion_gemma_checkpoint import GemmaArch
from unmask.models.diffusion_gemma_ops import fuse_rows
from unmask.models.layers import activation


class GeGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = activation(act)
        self._fused: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        w = self._fused
        if w is None or w.data_ptr() != self.gate_proj.weight.data_ptr():
            w = self._fused = fuse_rows(self.gate_proj, self.up_proj)
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Router(nn.Module):
    """Softmax top-k router on the RMS-normalised residual (DiffusionGemmaTextRouter)."""

    def __init__(self, a: GemmaArch):
        super().__init__()
        self.proj = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(a.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(a.num_experts))
        self.root = a.hidden_size ** -0.5
        self.eps, self.top_k = a.rms_eps, a.top_k_experts

    def forward(self, x_normed: Tensor) -> tuple[Tensor, Tensor]:
        """x_normed: the residual stream already RMS-normalised (no weight)."""
        probs = F.softmax(self.proj(x_normed * self.scale * self.root), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, k=self.top_k, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class Experts(nn.Module):
    """Fused expert weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    One grouped GEMM per projection over the (token, expert) pairs sorted by expert; the per-token sum
    over its k experts runs in slot order, as transformers' grouped_mm experts path does. Falls back
    to a loop over experts where grouped GEMM is unavailable for the device / dtype.
    """

    def __init__(self, a: GemmaArch):
        super().__init__()
        e, i, h = a.num_experts, a.moe_intermediate_size, a.hidden_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act = activation(a.act)
        self.grouped = _grouped_mm is not None

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        n, k = idx.shape
        if self.grouped:
            try:
                return self._grouped(x, idx, w, n, k)
            except (RuntimeError, NotImplementedError):
                # this torch build has no grouped-GEMM kernel for these dtypes/devices: use the
                # per-expert loop below from now on (same result, measured slower)
                self.grouped = False
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _grouped(self, x: Tensor, idx: Tensor, w: Tensor, n: int, k: int) -> Tensor:
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # counts by scatter_add, not bincount: CUDA's bincount reads the input's min and max back to the host
        # (two device syncs per layer per step)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        offs = counts.scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0).to(torch.int32)
        h = _grouped_mm(x[order // k], self.gate_up_proj.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = _grouped_mm(self.act(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        y = y * w.reshape(-1)[order, None]
        # back to (token, slot) order with a gather: `out[order] = y` takes CPU's index_put path, measured
        # ~150 us for 32 rows of 64 against a few us here
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return y[inverse].view(n, k, -1).sum(dim=1).to(x.dtype)
