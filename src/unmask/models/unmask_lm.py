"""unmask's own block-diffusion family (the built-in `unmask-tiny`).

Same layout as SDAR (Qwen3 names, q/k norms, block-causal, same-position logits), so the one
trainer serves both; the config carries `mask_token_id` and the trained `block_size`.
"""
from unmask.models.qwen_config import parse_qwen
from unmask.models.registry import Family, register

UNMASK = register(Family(
    name="unmask",
    architectures=("UnmaskForDiffusionLM",),
    attention="block_causal",
    shift=False,
    default_mask_id=3,
    default_block_size=8,
    parse_config=lambda c: parse_qwen(c, qkv_bias=False, qk_norm=True),
    extra_stop_ids=(2, 5),  # <|eos|>, <|im_end|>
))
