"""SDAR chat models (JetAstra/SDAR): Qwen3 weights with q/k norms, block-causal, same-position logits."""
from unmask.models.qwen_config import parse_qwen
from unmask.models.registry import Family, register

SDAR = register(Family(
    name="sdar",
    architectures=("SDARForCausalLM",),
    attention="block_causal",
    shift=False,
    default_mask_id=151669,
    default_block_size=4,
    parse_config=lambda c: parse_qwen(c, qkv_bias=False, qk_norm=True),
    extra_stop_ids=(151645, 151643),
))
