"""CPU linears through oneDNN on weights packed once: an inference transform, separable from the model code.

torch runs a float32 `F.linear` on the CPU through MKL's sgemm, whose few-row path is slow on this repository's
AMD EPYC machines: the built-in models' LM head (8,192 x 256) took 473 us for 4 rows and 705 us for 10, where
oneDNN on a weight reordered once into its blocked layout takes 103 and 230 us (`torch.ops.mkldnn`, the packed
linear inductor's CPU freezing emits; `bench/cpu_linear.py`, 2 threads, 2026-12-06). A speculative or diffusion
step feeds 4 to 30 rows, exactly that range. For bfloat16 the packed weight also skips the per-call reorder of
the default path (1.5-3.2x at 1-20 rows). Only a float32 matrix of under PACK_MIN_WORK row x weight elements
(a 256 x 256 projection at 1-4 rows: 7 us against 20 at one row) stays on MKL, where oneDNN's fixed cost
dominates.

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


def _onednn_rows(x: Tensor, w: Tensor, grad: bool, out_features: int) -> Tensor | None:
    """x as [rows, in] for a oneDNN call on a packed copy of `w` (out_features wide), or None where torch's
    default path is the one to take: autograd, another device or dtype, no rows, or a float32 product under
    PACK_MIN_WORK (MKL), or a forward being compiled. The one rule for single and fused linears."""
    if (x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != w.dtype or w.dtype not in _DTYPES
            or (torch.is_grad_enabled() and (x.requires_grad or grad)) or x.dim() < 2
            or torch.compiler.is_compiling()):  # traced (engine/compiled_step.py): inductor packs it itself
        return None
    rows = x.numel() // x.shape[-1]
    if rows == 0 or (w.dtype == torch.float32 and rows * x.shape[-1] * out_features < PACK_MIN_WORK):
        return None
    flat = x.reshape(rows, x.shape[-1])
    return flat if flat.is_contiguous() else flat.contiguous()


def packed_forward(m: nn.Linear, x: Tensor) -> Tensor:
    """m(x) through oneDNN on m's packed weight where that path applies (module docstring), else F.linear."""
    w = m.weight
    flat = _onednn_rows(x, w, w.requires_grad, w.shape[0])
    if flat is None:
        return F.linear(x, w, m.bias)
    bias = m.bias if m.bias is None or m.bias.dtype == w.dtype else m.bias.to(w.dtype)
    out = torch.ops.mkldnn._linear_pointwise(flat, packed_weight(m), bias, "none", [], "")
    return out.view(*x.shape[:-1], w.shape[0])


def packed_weight(m: nn.Linear) -> Tensor:
    """m's weight in oneDNN's blocked layout, reordered again whenever the weight was replaced or written."""
    w = m.weight
    key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
    if getattr(m, "_pack", None) is None or m._pack_key != key:
        m._pack = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        m._pack_key = key
    return m._pack


class FusedProjection:
    """Linears that read the same input (q/k/v, gate/up) run as one oneDNN product on their weights concatenated
    and packed once: one call and one output [..., sum of widths] instead of one per linear, whose fixed cost
    dominates at the few rows a decoding step feeds. Not a module: the model's parameters and state-dict names
    stay the members'. `__call__` returns None wherever `packed_forward` would not take the packed path (autograd,
    another device or dtype), so the caller runs the members as before; the packed weight is rebuilt when any
    member's weight is replaced or written (pointer and version counter)."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.widths = [m.weight.shape[0] for m in linears]
        self._pack: Tensor | None = None
        self._key: tuple | None = None

    def __call__(self, x: Tensor) -> Tensor | None:
        grad = any(m.weight.requires_grad for m in self.linears)
        flat = _onednn_rows(x, self.linears[0].weight, grad, sum(self.widths))
        if flat is None:
            return None   # the members' own path, as packed_forward would choose for each
        weight, bias = self._packed()
        out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def _packed(self) -> tuple[Tensor, Tensor | None]:
        key = tuple((t.data_ptr(), t._version, t.dtype) for m in self.linears
                    for t in (m.weight, m.bias) if t is not None)   # a bias written in place is fused again too
        if self._pack is None or self._key != key:
            w = torch.cat([m.weight.detach() for m in self.linears])
            biases = [m.bias for m in self.linears]
            bias = None if all(b is None for b in biases) else torch.cat(
                [(b.detach() if b is not None else torch.zeros(n, dtype=w.dtype)).to(w.dtype)
                 for b, n in zip(biases, self.widths)])
            self._pack, self._key = (torch.ops.mkldnn._reorder_linear_weight(w), bias), key
        return self._pack


FUSED_GROUPS = {"fused_qkv": ("q_proj", "k_proj", "v_proj"), "fused_gate_up": ("gate_proj", "up_proj")}


def fuse_projections(model: nn.Module) -> int:
    """Give each module whose FUSED_GROUPS members are all PackedLinear (of one dtype) a FusedProjection under
    the group's name, and drop the members' own packed copies (the fused one replaces them, so memory stays
    that of one packed copy); the number of groups fused. Draft adapters' linears are not PackedLinear, so a
    model with one keeps its separate products (a clean row must stay the base model's bit for bit)."""
    fused = 0
    for module in model.modules():
        for name, members in FUSED_GROUPS.items():
            linears = [getattr(module, m, None) for m in members]
            if not all(type(m) is PackedLinear for m in linears) or len({m.weight.dtype for m in linears}) != 1:
                continue
            group = FusedProjection(linears)
            group._packed()
            setattr(module, name, group)
            for m in linears:
                m._pack, m._pack_key = None, None
            fused += 1
    return fused


class PackedLinear(nn.Linear):
    """An nn.Linear whose no-grad CPU calls run oneDNN on a packed copy of its weight (module docstring)."""

    _pack: Tensor | None = None
    _pack_key: tuple | None = None

    def forward(self, x: Tensor) -> Tensor:
        return packed_forward(self, x)


def pack_linears(model: nn.Module, max_bytes: int = MAX_BYTES) -> int:
    """Turn every plain nn.Linear of a CPU model in float32 or bfloat16 into a PackedLinear and pack its weight
    now (so the memory it takes is taken before the engine reads what is free); the number swapped. 0, and the
    model unchanged, where oneDNN is missing, `UNMASK_ONEDNN_LINEAR=0`, the model is not on the CPU, or its
    linear weights exceed max_bytes. Subclasses of nn.Linear are left alone, but for those that set
    `follows_packing` (draft adapters): their base product then runs `packed_forward` too, so a clean row is the
    base model's bit for bit on either path."""
    if not (enabled_by_env() and packed_linear_available()):
        return 0
    linears = [m for m in model.modules() if (type(m) is nn.Linear or getattr(m, "follows_packing", False))
               and m.weight.device.type == "cpu" and m.weight.dtype in _DTYPES]
    if not linears or sum(m.weight.numel() * m.weight.element_size() for m in linears) > max_bytes:
        return 0
    try:
        for m in linears:
            if type(m) is nn.Linear:
                m.__class__ = PackedLinear
            else:  # a linear with more to do (a draft adapter): its base product takes the same path
                m.packed = True
            packed_weight(m)
        _check(linears[0])
        fuse_projections(model)
    except RuntimeError:  # a oneDNN build that cannot run this dtype here: keep torch's default everywhere
        for m in linears:
            if type(m) is PackedLinear:
                m.__class__ = nn.Linear
            m.packed, m._pack, m._pack_key = False, None, None
        for module in model.modules():
            for name in FUSED_GROUPS:
                module.__dict__.pop(name, None)
        return 0
    return len(linears)


def _check(m: nn.Linear) -> None:
    """One call on the packed path against F.linear: raises RuntimeError if oneDNN fails or disagrees."""
    w = m.weight
    x = torch.linspace(-1, 1, 8 * w.shape[1], dtype=torch.float32).view(8, -1).to(w.dtype)
    with torch.no_grad():
        got = torch.ops.mkldnn._linear_pointwise(x, packed_weight(m), m.bias, "none", [], "").float()
        want = F.linear(x, w, m.bias).float()
    tol = 1e-3 if w.dtype == torch.float32 else 5e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp_min(1))):
        raise RuntimeError("oneDNN's packed linear disagrees with F.linear")
