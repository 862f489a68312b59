"""unmask's own block-diffusion family (the built-in `unmask-tiny`).

Same layout as SDAR (Qwen3 names, q/k norms, block-causal, same-position logits), so the one
trainer serves both; the config carries `mask_token_id` and the trained `block_size`.
A model initialised from a left-to-right base (`unmask train --objective causal`) sets
`"shift_logits": true`: logits at i predict token i+1 and each block's first token comes from the
previous block's commit pass, the Fast-dLLM v2 recipe (arXiv 2509.26328) for keeping what the
causal base learned. `"causal_context": true` (with shift_logits) writes the committed blocks' K/V with
token-causal attention, as the causal base does; the block being denoised still reads itself
bidirectionally (unmask.train.objectives, "Causal context").
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
    shift_key="shift_logits",
    context_key="causal_context",
))
