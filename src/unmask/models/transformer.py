"""The decoder every family is built from, under one canonical parameter layout (Qwen names).

Families differ in configuration (norms, biases, qk-norm, partial RoPE, MoE) and in how their
checkpoints name parameters; each family module maps its names onto this layout.
Two entry points: `forward` over a ragged batch with KV caches (inference) and `forward_dense`
over a padded [B, L] batch with an explicit boolean mask (training).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unmask.models.attention import AttentionBatch, KVCache, ragged_attention
from unmask.models.draft_adapter import DraftAdapterConfig, DraftGate, add_draft_adapter
from unmask.models.kv_int8 import Int8KVCache
from unmask.models.layers import GatedMLP, GroupLimitedMoE, RMSNorm, Rotary
from unmask.models.two_stream import TwoStreamLayout, two_stream_attention

CAUSAL = "causal"  # forward_dense mask for left-to-right training (the AR base of an AR-initialised model)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_hidden: int
    n_group: int = 1
    topk_group: int = 1
    num_shared: int = 0
    routed_scaling: float = 1.0
    norm_topk: bool = True
    first_k_dense: int = 0


@dataclass(frozen=True)
class ArchConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    partial_rotary: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    act: str = "silu"
    moe: MoEConfig | None = None
    draft_adapter: DraftAdapterConfig | None = None  # low-rank weights for masked rows only (draft_adapter.py)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")


class Attention(nn.Module):
    fused_qkv = None   # models/cpu_linear.FusedProjection over q/k/v on the CPU (set by pack_linears)

    def __init__(self, cfg: ArchConfig, layer: int):
        super().__init__()
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer, self.h, self.kv, self.d = layer, h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps)
            self.k_norm = RMSNorm(d, cfg.rms_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: Tensor, rope: Rotary, cos: Tensor, sin: Tensor, ctx) -> Tensor:
        lead = x.shape[:-1]  # [N] ragged or [B, L] dense
        qkv = self.fused_qkv(x) if self.fused_qkv is not None else None
        if qkv is not None:   # one product; q and k then rotate in one call (RoPE acts per head)
            heads = qkv.view(*lead, self.h + 2 * self.kv, self.d)
            qk, v = heads[..., :self.h + self.kv, :], heads[..., self.h + self.kv:, :]
            if self.qk_norm:
                qk = torch.cat([self.q_norm(qk[..., :self.h, :]), self.k_norm(qk[..., self.h:, :])], dim=-2)
            qk = rope.apply(qk, cos, sin)
            q, k = qk[..., :self.h, :], qk[..., self.h:, :]
        else:
            q = self.q_proj(x).view(*lead, self.h, self.d)
            k = self.k_proj(x).view(*lead, self.kv, self.d)
            v = self.v_proj(x).view(*lead, self.kv, self.d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        if isinstance(ctx, AttentionBatch):
            out = ragged_attention(q, k, v, ctx, self.layer)
        elif hasattr(ctx, "attend"):  # a static-buffer step's rows over the KV pool (unmask.engine.static_step)
            out = ctx.attend(q, k, v, self.layer)
        else:  # dense training path: ctx is a [B, 1, L, L] bool mask, None (bidirectional) or CAUSAL
            hq, hk = q.transpose(1, 2), k.transpose(1, 2)
            hv = v.transpose(1, 2)
            if self.h != self.kv:
                hk = hk.repeat_interleave(self.h // self.kv, dim=1)
                hv = hv.repeat_interleave(self.h // self.kv, dim=1)
            if isinstance(ctx, str):  # CAUSAL: the kernel skips the upper triangle instead of reading a mask
                out = F.scaled_dot_product_attention(hq, hk, hv, is_causal=True).transpose(1, 2)
            elif isinstance(ctx, TwoStreamLayout):  # long block-diffusion rows: [x_t ; x_0] split by what rows see
                out = two_stream_attention(hq, hk, hv, ctx).transpose(1, 2)
            else:
                out = F.scaled_dot_product_attention(hq, hk, hv, attn_mask=ctx).transpose(1, 2)
        return self.o_proj(out.reshape(*lead, self.h * self.d))


class Block(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        m = cfg.moe
        if m is not None and layer >= m.first_k_dense:
            self.mlp = GroupLimitedMoE(cfg.hidden_size, m.expert_hidden, m.num_experts, m.top_k, m.n_group,
                                       m.topk_group, m.num_shared, m.routed_scaling, m.norm_topk, cfg.act)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.act)

    def forward(self, x: Tensor, rope: Rotary, cos: Tensor, sin: Tensor, ctx) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cos, sin, ctx)
        h = self.post_attention_layernorm(x)
        if getattr(ctx, "sync_free", False) and hasattr(self.mlp, "forward_sync_free"):  # a static step's MoE
            return x + self.mlp.forward_sync_free(h)
        return x + self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class DiffusionTransformer(nn.Module):
    """Token ids + absolute positions -> hidden states; `logits` projects selected rows only."""

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary)
        self.rope = Rotary(cfg.head_dim, cfg.rope_theta, rotary_dim, cfg.rope_scaling)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.draft_gate: DraftGate | None = None
        if cfg.draft_adapter is not None:
            self.enable_draft_adapter(cfg.draft_adapter)

    def enable_draft_adapter(self, adapter: DraftAdapterConfig) -> None:
        """Give the attention and MLP linears a draft adapter (a no-op until it trains; draft_adapter.py)."""
        if self.draft_gate is not None:
            raise ValueError("this model already has a draft adapter")
        self.draft_gate = DraftGate(adapter.mask_id)
        add_draft_adapter(self.model, adapter, self.draft_gate)

    def _run(self, ids: Tensor, positions: Tensor, ctx) -> Tensor:
        if self.draft_gate is not None:
            self.draft_gate.set(ids)
        x = self.model.embed_tokens(ids)
        cos, sin = self.rope.cos_sin(positions, sync_free=getattr(ctx, "sync_free", False))
        for layer in self.model.layers:
            x = layer(x, self.rope, cos, sin, ctx)
        return self.model.norm(x)

    def forward(self, input_ids: Tensor, positions: Tensor, batch: AttentionBatch) -> Tensor:
        """Ragged inference: input_ids/positions [N] flat over the batch's segments -> hidden [N, D]."""
        return self._run(input_ids, positions, batch)

    def forward_dense(self, input_ids: Tensor, positions: Tensor, mask: Tensor | str | None) -> Tensor:
        """Training: [B, L] ids/positions, mask [B|1, 1, L, L] bool (True = may attend), None (bidirectional),
        CAUSAL (plain left-to-right attention) or a TwoStreamLayout (block diffusion's [x_t ; x_0] without the
        dense mask) -> hidden [B, L, D]."""
        return self._run(input_ids, positions, mask)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def new_cache(self, capacity: int = 256, max_capacity: int | None = None,
                  dtype: torch.dtype | None = None) -> KVCache:
        """dtype: the cache's (None: the weights'; torch.int8: Int8KVCache); attention reads it back in the compute
        dtype."""
        c = self.cfg
        p = self.lm_head.weight
        if dtype == torch.int8:
            return Int8KVCache([(c.num_kv_heads, c.head_dim)] * c.num_layers, p.device, capacity, max_capacity)
        return KVCache([(c.num_kv_heads, c.head_dim)] * c.num_layers, dtype or p.dtype, p.device, capacity,
                       max_capacity)
