"""LLaDA2.0 (inclusionAI): Ling-style MoE, fused QKV, qk-norm, partial RoPE, block-causal, same-position logits."""
from __future__ import annotations

import torch

from unmask.errors import UnsupportedModelError
from unmask.models.registry import Family, Renames, StateDict, register
from unmask.models.transformer import ArchConfig, MoEConfig

_A = "model.layers.{i}.attention."
_S = "model.layers.{i}.self_attn."
NAMES = Renames((
    ("model.word_embeddings.weight", "model.embed_tokens.weight"),
    (_A + "query_layernorm.weight", _S + "q_norm.weight"),
    (_A + "key_layernorm.weight", _S + "k_norm.weight"),
    (_A + "dense.weight", _S + "o_proj.weight"),
    (_A + "dense.bias", _S + "o_proj.bias"),
))
_QKV = "model.layers.{}.attention.query_key_value.{}"


def parse_llada2(cfg: dict) -> ArchConfig:
    if cfg.get("score_function", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"LLaDA2 router score_function {cfg['score_function']!r} is not supported (only sigmoid)")
    heads = cfg["num_attention_heads"]
    moe = None
    if cfg.get("num_experts"):
        moe = MoEConfig(
            num_experts=cfg["num_experts"],
            top_k=cfg["num_experts_per_tok"],
            expert_hidden=cfg["moe_intermediate_size"],
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            num_shared=cfg.get("num_shared_experts") or 0,
            routed_scaling=cfg.get("routed_scaling_factor", 1.0),
            norm_topk=cfg.get("norm_topk_prob", True),
            first_k_dense=cfg.get("first_k_dense_replace", 0),
        )
    return ArchConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position=cfg.get("max_position_embeddings", 16384),
        rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rope_scaling=cfg.get("rope_scaling"),
        partial_rotary=cfg.get("partial_rotary_factor", 1.0),
        qkv_bias=cfg.get("use_qkv_bias", False),
        o_bias=cfg.get("use_bias", True),  # the reference class defaults to a dense bias when the key is absent
        qk_norm=cfg.get("use_qk_norm", True),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        act=cfg.get("hidden_act", "silu"),
        moe=moe,
    )


def split_qkv(state: StateDict, arch: ArchConfig) -> StateDict:
    """Fused rows [Q heads | K heads | V heads] -> separate q/k/v projections."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    out = dict(state)
    for i in range(arch.num_layers):
        for kind in ("weight", "bias"):
            fused = out.pop(_QKV.format(i, kind), None)
            if fused is None:
                continue
            if fused.shape[0] != q + 2 * kv:
                raise ValueError(f"{_QKV.format(i, kind)} has {fused.shape[0]} rows, expected {q + 2 * kv}")
            for name, part in zip(("q_proj", "k_proj", "v_proj"), fused.split([q, kv, kv], dim=0)):
                out[f"model.layers.{i}.self_attn.{name}.{kind}"] = part
    return out


def fuse_qkv(state: StateDict, arch: ArchConfig) -> StateDict:
    out = dict(state)
    for i in range(arch.num_layers):
        for kind in ("weight", "bias"):
            names = [f"model.layers.{i}.self_attn.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")]
            if names[0] in out:
                out[_QKV.format(i, kind)] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


LLADA2 = register(Family(
    name="llada2",
    architectures=("LLaDA2MoeModelLM",),
    attention="block_causal",
    shift=False,
    default_mask_id=156895,
    default_block_size=32,
    parse_config=parse_llada2,
    renames=NAMES,
    extra_stop_ids=(156892,),
    split_params=split_qkv,
    fuse_params=fuse_qkv,
))
