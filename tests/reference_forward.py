"""Naive dense float32 reference forward for every diffusion-LM family, written only from the
facts sheet docs/families.md (copy: /work/shared/reference/families.md), sections 0-5 and 8.

Deliberately slow and explicit: per-head loops, per-token MoE routing, a dense [L, L] boolean mask.
It reads `config.json` and the safetensors (single file or sharded index) by parameter name, so it
checks the on-disk layout as well as the math.

`reference_logits` returns RAW logits: row i is the model output at position i, with no logit shift.
Dream and Fast-dLLM v2 predict token i from row i-1 (families.md 2.3, 4.3, 8); applying that shift
is the caller's business. Everything is computed in float32 (bf16 checkpoints are upcast on load).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

Weights = dict[str, Tensor]


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------

def load_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def load_weights(model_dir: Path) -> Weights:
    """All tensors by name, as float32; follows `model.safetensors.index.json` when present."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: Weights = {}
    for f in files:
        out.update(load_file(str(model_dir / f)))
    return {k: v.float() for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# building blocks (families.md section 0 conventions)
# --------------------------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) in fp32, then * weight (plain weight, not 1 + w)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_cos_sin(length: int, rot_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Half-split tables [L, rot_dim]: inv_freq_j = theta^(-2j/rot_dim), freqs concatenated with
    themselves (families.md section 0, 'half-split RoPE')."""
    j = torch.arange(rot_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * j / rot_dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [L, D]. Rotates the first rot_dim = cos.shape[-1] channels with pairs (j, j + rot_dim/2);
    channels beyond rot_dim pass through (LLaDA2 partial rotary, families.md 5.3)."""
    rot_dim = cos.shape[-1]
    rot, rest = x[:, :rot_dim], x[:, rot_dim:]
    half = rot_dim // 2
    rotated_half = torch.cat([-rot[:, half:], rot[:, :half]], dim=-1)
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)


def attention_allowed(length: int, attention: str) -> Tensor:
    """Boolean [L, L], allowed[i, j] = query i may attend key j (absolute positions from 0).

    "bidirectional": all; "causal": j <= i; "block_causal:B": j // B <= i // B (families.md 8)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    if attention == "bidirectional":
        return torch.ones(length, length, dtype=torch.bool)
    if attention == "causal":
        return j <= i
    if attention.startswith("block_causal:"):
        block = int(attention.split(":", 1)[1])
        if block < 1:
            raise ValueError(f"bad block size in {attention!r}")
        return (j // block) <= (i // block)
    raise ValueError(f"unknown attention {attention!r}")


def attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """q: [Hq, L, D], k/v: [Hkv, L, D] -> [L, Hq*D]. GQA: query head h uses kv head h // (Hq/Hkv).
    Scale head_dim^-0.5; softmax over allowed keys only."""
    n_q, length, d = q.shape
    group = n_q // k.shape[0]
    outs = []
    for h in range(n_q):
        kv = h // group
        scores = (q[h] @ k[kv].T) / math.sqrt(d)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ v[kv])
    return torch.cat(outs, dim=-1)


def swiglu(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    """down( silu(gate(x)) * up(x) )."""
    return (torch.nn.functional.silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """[L, H*D] -> [H, L, D] (each head's D channels contiguous)."""
    length = x.shape[0]
    return x.view(length, n_heads, -1).transpose(0, 1)


# --------------------------------------------------------------------------------------------
# LLaDA (families.md 1.2, 1.3)
# --------------------------------------------------------------------------------------------

def _llada_forward(cfg: dict[str, Any], w: Weights, ids: Tensor, allowed: Tensor) -> Tensor:
    assert cfg["block_type"] == "llama" and cfg.get("block_group_size", 1) == 1
    assert not cfg["include_bias"] and not cfg.get("include_qkv_bias", False)
    assert not cfg["attention_layer_norm"] and not cfg.get("input_emb_norm", False)
    assert not cfg.get("scale_logits", False) and not cfg.get("alibi", False) and cfg["rope"]
    d, n_h, n_kv, eps = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["rms_norm_eps"]
    hd = d // n_h
    cos, sin = rope_cos_sin(len(ids), hd, cfg["rope_theta"])
    x = w["model.transformer.wte.weight"][ids]
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        a = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = split_heads(a @ w[p + "q_proj.weight"].T, n_h)
        k = split_heads(a @ w[p + "k_proj.weight"].T, n_kv)
        v = split_heads(a @ w[p + "v_proj.weight"].T, n_kv)
        q = torch.stack([apply_rope(qh, cos, sin) for qh in q])
        k = torch.stack([apply_rope(kh, cos, sin) for kh in k])
        x = x + attention(q, k, v, allowed) @ w[p + "attn_out.weight"].T
        m = rms_norm(x, w[p + "ff_norm.weight"], eps)
        # ff_proj is the gate (activation applied), up_proj is multiplied, ff_out is down.
        x = x + swiglu(m, w[p + "ff_proj.weight"], w[p + "up_proj.weight"], w[p + "ff_out.weight"])
    x = rms_norm(x, w["model.transformer.ln_f.weight"], eps)
    head = w["model.transformer.wte.weight"] if cfg["weight_tying"] else w["model.transformer.ff_out.weight"]
    return x @ head.T


# --------------------------------------------------------------------------------------------
# Qwen2 / Qwen3 layout: Dream, Fast-dLLM v2, SDAR (families.md 2.2-2.3, 3.2-3.3, 4.2-4.3)
# --------------------------------------------------------------------------------------------

def _qwen_forward(cfg: dict[str, Any], w: Weights, ids: Tensor, allowed: Tensor, *, qk_norm: bool) -> Tensor:
    assert cfg.get("rope_scaling") is None and not cfg.get("use_sliding_window", False)
    assert cfg.get("hidden_act", "silu") == "silu"
    h, n_q, n_kv, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hd = cfg.get("head_dim") or h // n_q
    cos, sin = rope_cos_sin(len(ids), hd, cfg["rope_theta"])
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, w[p + "input_layernorm.weight"], eps)

        def proj(name: str) -> Tensor:
            out = a @ w[p + f"self_attn.{name}.weight"].T
            bias = w.get(p + f"self_attn.{name}.bias")  # Dream / Fast-dLLM v2 have q/k/v biases
            return out if bias is None else out + bias

        q, k, v = split_heads(proj("q_proj"), n_q), split_heads(proj("k_proj"), n_kv), split_heads(proj("v_proj"), n_kv)
        if qk_norm:  # SDAR (Qwen3): per-head RMSNorm over head_dim, before RoPE
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = torch.stack([apply_rope(qh, cos, sin) for qh in q])
        k = torch.stack([apply_rope(kh, cos, sin) for kh in k])
        x = x + attention(q, k, v, allowed) @ w[p + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + swiglu(m, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return x @ head.T


# --------------------------------------------------------------------------------------------
# LLaDA2.0 MoE (families.md 5.2, 5.3)
# --------------------------------------------------------------------------------------------

def moe_route(logits: Tensor, expert_bias: Tensor | None, cfg: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """One token's router. logits: [E] (x @ gate.T). Returns (expert ids [k], combine weights [k]).

    s = sigmoid(logits); selection on s + expert_bias: group score = sum of the top-2 biased scores
    of each of n_group groups, keep topk_group groups, then top-k experts inside them. Weights are
    the UNBIASED s of the chosen experts, normalised to sum 1 (norm_topk_prob), times
    routed_scaling_factor."""
    assert cfg.get("score_function", "sigmoid") == "sigmoid"
    scores = torch.sigmoid(logits.float())
    choice = scores + expert_bias if expert_bias is not None else scores.clone()
    n_exp, n_group = scores.shape[0], cfg["n_group"]
    groups = choice.view(n_group, n_exp // n_group)
    group_scores = groups.topk(min(2, groups.shape[1]), dim=-1).values.sum(-1)
    kept_groups = group_scores.topk(cfg["topk_group"]).indices
    allowed = torch.zeros(n_group, dtype=torch.bool)
    allowed[kept_groups] = True
    masked = choice.masked_fill(~allowed.repeat_interleave(n_exp // n_group), float("-inf"))
    experts = masked.topk(cfg["num_experts_per_tok"]).indices
    weights = scores[experts]
    if cfg.get("norm_topk_prob", True):
        weights = weights / weights.sum()
    return experts, weights * cfg["routed_scaling_factor"]


def _llada2_moe(x: Tensor, w: Weights, p: str, cfg: dict[str, Any]) -> Tensor:
    """Per-token routed experts + the always-on shared expert."""
    out = torch.zeros_like(x)
    bias = w.get(p + "mlp.gate.expert_bias")
    for t in range(x.shape[0]):
        experts, weights = moe_route(x[t] @ w[p + "mlp.gate.weight"].T, bias, cfg)
        for e, wt in zip(experts.tolist(), weights):
            ep = p + f"mlp.experts.{e}."
            out[t] += wt * swiglu(x[t:t + 1], w[ep + "gate_proj.weight"], w[ep + "up_proj.weight"],
                                  w[ep + "down_proj.weight"])[0]
    if cfg.get("num_shared_experts", 0):
        sp = p + "mlp.shared_experts."
        out = out + swiglu(x, w[sp + "gate_proj.weight"], w[sp + "up_proj.weight"], w[sp + "down_proj.weight"])
    return out


def _llada2_forward(cfg: dict[str, Any], w: Weights, ids: Tensor, allowed: Tensor) -> Tensor:
    assert cfg.get("rope_scaling") is None and not cfg.get("norm_head", False)
    h, n_q, n_kv, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    hd = cfg.get("head_dim") or h // n_q
    rot_dim = int(hd * cfg.get("partial_rotary_factor", 1.0))
    cos, sin = rope_cos_sin(len(ids), rot_dim, cfg["rope_theta"])
    x = w["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        qkv = a @ w[p + "attention.query_key_value.weight"].T
        if p + "attention.query_key_value.bias" in w:
            qkv = qkv + w[p + "attention.query_key_value.bias"]
        # fused rows: [Q (n_q heads) | K (n_kv heads) | V (n_kv heads)], each head hd contiguous
        q, k, v = qkv.split([n_q * hd, n_kv * hd, n_kv * hd], dim=-1)
        q, k, v = split_heads(q, n_q), split_heads(k, n_kv), split_heads(v, n_kv)
        if cfg.get("use_qk_norm", False):
            q = rms_norm(q, w[p + "attention.query_layernorm.weight"], eps)
            k = rms_norm(k, w[p + "attention.key_layernorm.weight"], eps)
        q = torch.stack([apply_rope(qh, cos, sin) for qh in q])
        k = torch.stack([apply_rope(kh, cos, sin) for kh in k])
        att = attention(q, k, v, allowed) @ w[p + "attention.dense.weight"].T
        if p + "attention.dense.bias" in w:
            att = att + w[p + "attention.dense.bias"]
        x = x + att
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            x = x + swiglu(m, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
        else:
            x = x + _llada2_moe(m, w, p, cfg)
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.word_embeddings.weight"] if cfg.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return x @ head.T


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------

def family_of(cfg: dict[str, Any]) -> str:
    """model_type -> family key of tests/tiny_checkpoints.FAMILIES (families.md section 0)."""
    return {"llada": "llada", "Dream": "dream", "sdar": "sdar", "Fast_dLLM_Qwen": "fast_dllm_v2",
            "llada2_moe": "llada2"}[cfg["model_type"]]


@torch.no_grad()
def reference_logits(model_dir: Path, input_ids: Tensor, attention: str) -> Tensor:
    """Raw float32 logits [1, L, V] of the checkpoint in `model_dir` for `input_ids` [1, L].

    `attention`: "bidirectional", "causal" or "block_causal:B" (query i sees key j iff
    j // B <= i // B, positions counted from 0). Positions are 0..L-1. No logit shift is applied
    (Dream / Fast-dLLM v2 callers must shift: prediction for token i is row i-1)."""
    return logits_from_weights(load_config(model_dir), load_weights(model_dir), input_ids, attention)


@torch.no_grad()
def logits_from_weights(cfg: dict[str, Any], weights: Weights, input_ids: Tensor, attention: str) -> Tensor:
    """`reference_logits` on an already loaded (config.json dict, float32 state dict) pair."""
    assert input_ids.dim() == 2 and input_ids.shape[0] == 1, "batch of one"
    w = {k: v.float() for k, v in weights.items()}
    ids = input_ids[0].long().cpu()
    allowed = attention_allowed(len(ids), attention)
    family = family_of(cfg)
    if family == "llada":
        logits = _llada_forward(cfg, w, ids, allowed)
    elif family == "llada2":
        logits = _llada2_forward(cfg, w, ids, allowed)
    else:
        logits = _qwen_forward(cfg, w, ids, allowed, qk_norm=family == "sdar")
    return logits.float()[None]
