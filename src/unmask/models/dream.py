"""Dream-v0 (and DiffuCoder, Dream-Coder): Qwen2 weights, bidirectional, shifted logits.

DreamLM/Dream: prediction for position j is read from the hidden state at j-1.
"""
from unmask.models.qwen_config import parse_qwen
from unmask.models.registry import Family, register

DREAM = register(Family(
    name="dream",
    architectures=("DreamModel",),
    attention="bidirectional",
    shift=True,
    default_mask_id=151666,
    default_block_size=32,
    parse_config=lambda c: parse_qwen(c, qkv_bias=True, qk_norm=False),
    extra_stop_ids=(151643,),
))
