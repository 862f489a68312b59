"""Layers shared by every family: norms, rotary embeddings, gated MLPs, mixture of experts."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unmask.errors import UnsupportedModelError


# torch >= 2.4's fused RMSNorm: one kernel on CUDA; on the CPU (torch 2.13) it runs as pow, mean, rsqrt and two
# products, slower than the formula below in float32 (bench/prefill_cost.py layers; docs/benchmarks.md)
_RMS_NORM = getattr(F, "rms_norm", None)


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, computed in float32, returned in x's dtype.

    Off CUDA: the sum of squares in one pass with float32 accumulation (no x^2 temporary, no float32 copy of a
    half-precision x: the product promotes), the [..., 1] factors apart, then one product and the cast back."""
    if x.is_cuda and _RMS_NORM is not None:
        return _RMS_NORM(x, (x.shape[-1],), eps=eps).to(x.dtype)  # .to: under autocast it returns float32
    ss = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return (x * torch.rsqrt(ss.square() / x.shape[-1] + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then scale (LLaDA/Qwen convention: weight, not 1 + weight)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        y = rms_normalize(x, self.eps)  # a new tensor: without autograd it can take the scale in place
        if y.dtype == self.weight.dtype and not torch.is_grad_enabled():
            return y.mul_(self.weight)
        return self.weight * y


ACTIVATIONS = {
    "silu": F.silu,
    "swiglu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); parameter names are set by the family through `names`."""

    def __init__(self, dim: int, hidden: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    fused_gate_up = None   # models/cpu_linear.FusedProjection over gate/up on the CPU (set by pack_linears)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.fused_gate_up(x) if self.fused_gate_up is not None else None
        if gate_up is not None:
            gate, up = gate_up.split(self.down_proj.weight.shape[1], dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------- rotary embeddings

def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> tuple[Tensor, float]:
    """Inverse frequencies for half-split RoPE and the cos/sin magnitude (YaRN's attention factor)."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv.float(), 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv / factor).float(), 1.0
    if kind == "llama3":  # Llama 3.1 frequency-dependent interpolation
        old = scaling["original_max_position_embeddings"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    if kind == "yarn":  # arXiv 2309.00071: blend interpolated and extrapolated bands
        old = scaling.get("original_max_position_embeddings", 4096)
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

        def corr(rot: float) -> float:
            return rotary_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        mixed = (inv / factor) * (1 - extrapolate) + inv * extrapolate
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0)
        return mixed.float(), float(mscale)
    raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn")


class Rotary(nn.Module):
    """Half-split ("rotate_half") RoPE on the first `rotary_dim` channels, computed in float32."""

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None, scaling: dict | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        # a plain attribute, not a buffer: stays float32 on the CPU through .to(dtype) and meta init
        self.inv_freq, self.mscale = rope_inv_freq(self.rotary_dim, theta, scaling)
        self._table: tuple[Tensor, Tensor] | None = None  # CPU: cos/sin of positions 0..n-1, grown on demand

    def cos_sin(self, positions: Tensor, sync_free: bool = False) -> tuple[Tensor, Tensor]:
        """cos and sin of each position's angles, [..., rotary_dim / 2] (the two halves of the rotation share
        them), times YaRN's magnitude. On the CPU they are read from a table that grows to the farthest position
        seen (the same float32 products and cos/sin, so the same values): one index per table instead of a
        product, cos, sin and their scaling at every forward. On other devices, and in a static step that must
        read nothing back to the host (`sync_free`: the table's size check reads the farthest position), they are
        computed."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if positions.device.type != "cpu" or positions.numel() == 0 or sync_free:
            return self._angles(positions)
        need = int(positions.max()) + 1
        if self._table is None or self._table[0].shape[0] < need:
            n = max(256, 1 << (need - 1).bit_length())
            self._table = self._angles(torch.arange(n))
        flat = positions.reshape(-1)
        return tuple(t.index_select(0, flat).view(*positions.shape, -1) for t in self._table)

    def _angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        c, s = freqs.cos(), freqs.sin()
        if self.mscale != 1.0:
            c, s = c * self.mscale, s * self.mscale
        return c, s

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [..., L, H, D]; cos/sin [..., L, rotary_dim / 2] (cos_sin's).

        (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in float32 (the products promote a half-precision x: no
        float32 copy of it, no rotated copy). Without autograd the halves are written into one output buffer."""
        r, half = self.rotary_dim, self.rotary_dim // 2
        c, s = cos[..., None, :], sin[..., None, :]
        x1, x2 = x[..., :half], x[..., half:r]
        if (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad)
                or torch.compiler.is_compiling()):  # out= has no backward and is not traced
            out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        else:
            out = torch.empty((*x.shape[:-1], r), dtype=torch.float32, device=x.device)
            torch.mul(x1, c, out=out[..., :half]).addcmul_(x2, s, value=-1)
            torch.mul(x2, c, out=out[..., half:]).addcmul_(x1, s)
        out = out.to(x.dtype)
        return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


# ---------------------------------------------------------------- mixture of experts

class GroupLimitedMoE(nn.Module):
    """Sigmoid-scored, group-limited top-k MoE with a shared expert (LLaDA2 / DeepSeek-V3 style).

    Expert choice uses scores + expert_bias; combine weights use the unbiased scores,
    renormalised and multiplied by routed_scaling_factor (inclusionAI LLaDA2.0 modelling file).
    """

    def __init__(self, dim: int, expert_hidden: int, num_experts: int, top_k: int, n_group: int,
                 topk_group: int, num_shared: int, scaling: float, norm_topk: bool, act: str = "silu"):
        super().__init__()
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.gate.register_buffer("expert_bias", torch.zeros(num_experts))
        self.experts = nn.ModuleList(GatedMLP(dim, expert_hidden, act) for _ in range(num_experts))
        self.shared_experts = GatedMLP(dim, expert_hidden * num_shared, act) if num_shared else None
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.scaling, self.norm_topk = scaling, norm_topk
        self._stack: tuple[Tensor, Tensor, Tensor] | bool | None = None  # see _stacked

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))  # [N, E]
        biased = scores + self.gate.expert_bias.float()
        n = x.shape[0]
        if self.n_group > 1:
            grouped = biased.view(n, self.n_group, -1)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_score.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            biased = biased.masked_fill(~group_mask.repeat_interleave(self.num_experts // self.n_group, 1), float("-inf"))
        idx = biased.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.route(x)
        out = torch.zeros_like(x, dtype=torch.float32)
        # loop over experts that received tokens: the cheap way on CPU and at small batch
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]).float() * w[rows, slot, None])
        return self._finish(out, x, shape)

    def forward_sync_free(self, x: Tensor) -> Tensor:
        """The same sum without reading the routing back to the host, so a CUDA graph can capture it: grouped
        GEMMs over the rows sorted by expert (`forward_grouped`) where torch has them for these weights, else
        every expert over every row, weighted by the row's routing weight for it (0 where it was not chosen),
        which costs num_experts / top_k times the routed FLOPs."""
        stack = self._stacked()
        if stack is not None:
            return self.forward_grouped(x, stack)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.route(x)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e, expert in enumerate(self.experts):  # ascending, as the loop adds them
            we = (w * (idx == e)).sum(-1)
            out += expert(x).float() * we[:, None]
        return self._finish(out, x, shape)

    def forward_grouped(self, x: Tensor, stack: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """Rows sorted by expert, then one grouped GEMM per projection (torch._grouped_mm, the kernel torchtitan's
        MoE uses, with [E, in, out] weights and the groups' end offsets); no host read anywhere."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.route(x)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)       # (row, slot) pairs grouped by expert, rows ascending
        rows = order // idx.shape[1]
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount reads its max back; this does not
        offs = counts.cumsum(0, dtype=torch.int32)
        xs = x[rows]
        gate, up, down = (s.transpose(1, 2) for s in stack)
        h = self.experts[0].act(torch._grouped_mm(xs, gate, offs=offs)) * torch._grouped_mm(xs, up, offs=offs)
        y = torch._grouped_mm(h, down, offs=offs)
        # each row's experts are added in ascending order, as the loop adds them
        out = torch.zeros_like(x, dtype=torch.float32).index_add_(0, rows, y.float() * w.reshape(-1)[order, None])
        return self._finish(out, x, shape)

    def _stacked(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The experts' gate, up and down weights as [E, out, in] tensors, built once, with each expert's own
        parameters made views of them (no second copy of the experts); None where torch has no grouped GEMM for
        them (no torch._grouped_mm, biases, widths off its 16-byte alignment, CUDA weights other than bf16)."""
        w0 = self.experts[0].gate_proj.weight
        if self._stack and self._stack[0][0].data_ptr() != w0.data_ptr():  # the module was moved or reloaded
            self._stack = None
        if self._stack is None:
            ok = (hasattr(torch, "_grouped_mm") and self.experts[0].gate_proj.bias is None
                  and all(n * w0.element_size() % 16 == 0 for n in w0.shape)
                  and w0.dtype in ((torch.bfloat16,) if w0.is_cuda else (torch.bfloat16, torch.float32)))
            self._stack = False
            if ok:
                stacks = []
                for name in ("gate_proj", "up_proj", "down_proj"):
                    stack = torch.stack([getattr(e, name).weight.data for e in self.experts])
                    for e, expert in enumerate(self.experts):
                        getattr(expert, name).weight.data = stack[e]
                    stacks.append(stack)
                self._stack = tuple(stacks)
        return self._stack or None

    def _finish(self, out: Tensor, x: Tensor, shape: torch.Size) -> Tensor:
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)
