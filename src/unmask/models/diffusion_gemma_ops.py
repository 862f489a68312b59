"""Gemma 4 tensor pieces DiffusionGemma's layers share: RMSNorm (float32 inside), RoPE frequencies and rotation,
and fused projection weights. The network itself is in diffusion_gemma.py."""
from __future__ import annotations

import torch
from torch import Tensor, nn


class GemmaRMSNorm(nn.Module):
    """Gemma 4 RMSNorm: all in float32, x * (mean(x^2) + eps)^-1/2 * weight (plain weight, optional)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:
        out = normalized(x, self.eps)
        if self.weight is not None:
            out = out * to_f32(self.weight)
        return cast_like(out, x)


# dtype casts that skip the dispatcher when they would be no-ops (a tiny model's step is mostly op overhead)
def to_f32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.float()


def cast_like(x: Tensor, ref: Tensor) -> Tensor:
    return x if x.dtype == ref.dtype else x.to(ref.dtype)


def normalized(x: Tensor, eps: float) -> Tensor:
    """float32 x * (mean(x^2) + eps)^-1/2 over the last dim (the shared part of every Gemma RMSNorm)."""
    xf = to_f32(x)
    return xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)


def rms_unweighted(x: Tensor, eps: float) -> Tensor:
    return cast_like(normalized(x, eps), x)


def inv_freq(kind: str, head_dim: int, theta: float, partial: float, factor: float) -> Tensor:
    """Per layer type, float32 as the reference computes it (modeling_rope_utils)."""
    if kind == "default":
        dim = int(head_dim * partial)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
    # "proportional": the first int(partial * head_dim / 2) frequencies use the *full* head_dim as the
    # denominator, the rest are 0 (those channels are not rotated); cos/sin still span the whole head
    angles = int(partial * head_dim // 2)
    rot = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rest = head_dim // 2 - angles
    out = torch.cat([rot, torch.zeros(rest, dtype=torch.float32, device="cpu")]) if rest > 0 else rot
    return out / factor


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split RoPE over the whole head; x [N, H, D], cos/sin [N, D] in x's dtype."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]

def fuse_rows(*linears: nn.Linear) -> Tensor:
    """One [sum(out), in] weight whose row blocks the given linears' weights become views of.

    A single GEMM then computes all projections (bitwise the same rows on CPU, measured); the
    parameters keep their names for state_dict. Rebuilt if the parameters were replaced (.to()).
    """
    fused = torch.cat([m.weight.detach() for m in linears])
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = fused[row:row + n]
        row += n
    return fused
