"""Parse Hugging Face Qwen2/Qwen3-style config keys, shared by Dream, SDAR, Fast-dLLM v2 and unmask."""
from __future__ import annotations

from unmask.errors import UnsupportedModelError
from unmask.models.draft_adapter import DraftAdapterConfig
from unmask.models.transformer import ArchConfig


def parse_qwen(cfg: dict, *, qkv_bias: bool, qk_norm: bool) -> ArchConfig:
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention (use_sliding_window: true) is not supported")
    heads = cfg["num_attention_heads"]
    return ArchConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        max_position=cfg.get("max_position_embeddings", 32768),
        rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rope_scaling=cfg.get("rope_scaling"),
        qkv_bias=cfg.get("attention_bias", qkv_bias),
        qk_norm=qk_norm,
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        act=cfg.get("hidden_act", "silu"),
        draft_adapter=DraftAdapterConfig.from_config(cfg.get("draft_adapter")),
    )
