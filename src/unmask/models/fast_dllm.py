"""Fast-dLLM v2 (NVlabs): Qwen2.5 weights, block-causal over bd_size blocks, shifted logits.

The reference takes each block's first token greedily from the pass that commits the previous
block (arXiv 2509.26328), which `ar_first_token` reproduces.
"""
from unmask.models.qwen_config import parse_qwen
from unmask.models.registry import Family, register

FAST_DLLM_V2 = register(Family(
    name="fast_dllm_v2",
    architectures=("Fast_dLLM_QwenForCausalLM",),
    attention="block_causal",
    shift=True,
    default_mask_id=151665,
    default_block_size=32,
    block_size_keys=("bd_size", "block_size"),
    parse_config=lambda c: parse_qwen(c, qkv_bias=True, qk_norm=False),
    extra_stop_ids=(151645,),
    ar_first_token=True,
))
