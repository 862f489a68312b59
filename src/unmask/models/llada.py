"""LLaDA-8B (Base / Instruct / 1.5): OLMo-style config and names, bidirectional, same-position logits."""
from unmask.errors import UnsupportedModelError
from unmask.models.registry import Family, Renames, register
from unmask.models.transformer import ArchConfig

_B = "model.transformer.blocks.{i}."
_L = "model.layers.{i}."
NAMES = Renames((
    ("model.transformer.wte.weight", "model.embed_tokens.weight"),
    (_B + "attn_norm.weight", _L + "input_layernorm.weight"),
    (_B + "q_proj.weight", _L + "self_attn.q_proj.weight"),
    (_B + "k_proj.weight", _L + "self_attn.k_proj.weight"),
    (_B + "v_proj.weight", _L + "self_attn.v_proj.weight"),
    (_B + "attn_out.weight", _L + "self_attn.o_proj.weight"),
    (_B + "ff_norm.weight", _L + "post_attention_layernorm.weight"),
    (_B + "ff_proj.weight", _L + "mlp.gate_proj.weight"),
    (_B + "up_proj.weight", _L + "mlp.up_proj.weight"),
    (_B + "ff_out.weight", _L + "mlp.down_proj.weight"),
    ("model.transformer.ln_f.weight", "model.norm.weight"),
    ("model.transformer.ff_out.weight", "lm_head.weight"),
))


def parse_llada(cfg: dict) -> ArchConfig:
    unsupported = {
        "block_type": cfg.get("block_type", "llama") != "llama",
        "layer_norm_type": cfg.get("layer_norm_type", "rms") != "rms",
        "attention_layer_norm": bool(cfg.get("attention_layer_norm")),
        "alibi": bool(cfg.get("alibi")),
        "scale_logits": bool(cfg.get("scale_logits")),
        "include_bias": bool(cfg.get("include_bias")) or bool(cfg.get("include_qkv_bias")),
        "block_group_size": cfg.get("block_group_size", 1) != 1,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise UnsupportedModelError(f"LLaDA config uses unsupported feature(s): {', '.join(bad)}")
    d = cfg["d_model"]
    heads = cfg["n_heads"]
    return ArchConfig(
        vocab_size=cfg.get("embedding_size") or cfg["vocab_size"],
        hidden_size=d,
        num_layers=cfg["n_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("n_kv_heads") or heads,
        head_dim=d // heads,
        intermediate_size=cfg.get("mlp_hidden_size") or cfg.get("mlp_ratio", 4) * d,
        max_position=cfg.get("max_sequence_length", 4096),
        rms_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rope_scaling=cfg.get("rope_scaling"),
        tie_embeddings=bool(cfg.get("weight_tying", False)),
        act=cfg.get("activation_type", "silu"),
    )


LLADA = register(Family(
    name="llada",
    architectures=("LLaDAModelLM",),
    attention="bidirectional",
    shift=False,
    default_mask_id=126336,
    default_block_size=32,
    parse_config=parse_llada,
    renames=NAMES,
    extra_stop_ids=(126081, 126348),  # <|endoftext|>, <|eot_id|>
))
