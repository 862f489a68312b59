"""CPU linears through oneDNN on weights packed once: an inference transform, separable from the model code.

torch runs a float32 `F.linear` on the CPU through MKL's sgemm, whose few-row path is slow on this repository's
AMD EPYC machines: the built-in models' LM head (8,192 x 256) took 575 us for 4 rows and 850 us for 10, where
oneDNN on a weight reordered once into its blocked layout takes 130 and 223 us (`torch.ops.mkldnn`, the packed
linear inductor's CPU freezing emits; scratch timing, 2 threads, 2026-12-06). A speculative or diffusion step
feeds 4 to 30 rows, exactly that range. For bfloat16 the packed weight also skips the per-call reorder of the
default path (1.5-3.5x at 1-3 rows). Only a float32 matrix of under PACK_MIN_WORK row x weight elements
(a 256 x 256 projection at 1-3 rows: 13 us against 37) stays on MKL, where oneDNN's fixed cost dominates.

The swap changes each `nn.Linear`'s class in place (same parameters and state-dict names); a call with autograd
on, off the CPU, or in another dtype runs the plain `F.linear`. The packed copy is refreshed when the weight is
replaced or changed in place (its data pointer or version counter moves), so training and LoRA merges stay
correct. It holds a second copy of each packed weight: `pack_linears` skips models whose linear weights exceed
`max_bytes`. Results equal `F.linear`'s to float rounding (not bit for bit: another summation order).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ENV = "UNMASK_ONEDNN_LINEAR"          # 0: keep every linear on torch's default CPU path
MAX_BYTES = 2 << 30                   # a second copy of up to this many bytes of linear weights
PACK_MIN_WORK = 300_000               # float32 calls with rows x weight elements under this stay on MKL
_DTYPES = (torch.float32, torch.bfloat16)


def packed_linear_available() -> bool:
    """This torch build has oneDNN's packed linear ops and oneDNN is usable on this CPU."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight"))


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class PackedLinear(nn.Linear):
    """An nn.Linear whose no-grad CPU calls run oneDNN on a packed copy of its weight (module docstring)."""

    _pack: Tensor | None = None
    _pack_key: tuple | None = None

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != w.dtype or w.dtype not in _DTYPES
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) or x.dim() < 2):
            return F.linear(x, w, self.bias)
        rows = x.numel() // x.shape[-1]
        if rows == 0 or (w.dtype == torch.float32 and rows * w.numel() < PACK_MIN_WORK):
            return F.linear(x, w, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        bias = self.bias if self.bias is None or self.bias.dtype == w.dtype else self.bias.to(w.dtype)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight(), bias, "none", [], "")
        return out.view(*x.shape[:-1], w.shape[0])

    def packed_weight(self) -> Tensor:
        """The weight in oneDNN's blocked layout, reordered again whenever the weight was replaced or written."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if self._pack is None or self._pack_key != key:
            self._pack = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            self._pack_key = key
        return self._pack


def linear_weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is nn.Linear)


def pack_linears(model: nn.Module, max_bytes: int = MAX_BYTES) -> int:
    """Turn every plain nn.Linear of a CPU model in float32 or bfloat16 into a PackedLinear and pack its weight
    now (so the memory it takes is taken before the engine reads what is free); the number swapped. 0, and the
    model unchanged, where oneDNN is missing, `UNMASK_ONEDNN_LINEAR=0`, the model is not on the CPU, or its
    linear weights exceed max_bytes. Subclasses of nn.Linear (draft adapters, LoRA layers) are left alone."""
    if not (enabled_by_env() and packed_linear_available()):
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear
               and m.weight.device.type == "cpu" and m.weight.dtype in _DTYPES]
    if not linears or sum(m.weight.numel() * m.weight.element_size() for m in linears) > max_bytes:
        return 0
    try:
        for m in linears:
            m.__class__ = PackedLinear
            m.packed_weight()
        _check(linears[0])
    except RuntimeError:  # a oneDNN build that cannot run this dtype here: keep torch's default everywhere
        for m in linears:
            m.__class__, m._pack, m._pack_key = nn.Linear, None, None
        return 0
    return len(linears)


def _check(m: PackedLinear) -> None:
    """One call on the packed path against F.linear: raises RuntimeError if oneDNN fails or disagrees."""
    w = m.weight
    x = torch.linspace(-1, 1, 8 * w.shape[1], dtype=torch.float32).view(8, -1).to(w.dtype)
    with torch.no_grad():
        got = torch.ops.mkldnn._linear_pointwise(x, m.packed_weight(), m.bias, "none", [], "").float()
        want = F.linear(x, w, m.bias).float()
    tol = 1e-3 if w.dtype == torch.float32 else 5e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp_min(1))):
        raise RuntimeError("oneDNN's packed linear disagrees with F.linear")
