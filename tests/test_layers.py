"""Shared layers against transformers' own implementations of the same formulas."""
import pytest
import torch
from transformers import Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from unmask.errors import UnsupportedModelError
from unmask.models.layers import Rotary, rope_inv_freq

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_rope_scaling_matches_transformers(scaling):
    cfg = Qwen2Config(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
                      rope_parameters={"rope_theta": 1e6, **scaling})
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    inv, scale = rope_inv_freq(128, 1e6, scaling)
    assert torch.allclose(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_partial_rotary_leaves_tail_channels():
    rope = Rotary(head_dim=16, theta=10000.0, rotary_dim=8)
    x = torch.randn(5, 2, 16)
    cos, sin = rope.cos_sin(torch.arange(5))
    y = rope.apply(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert torch.allclose(y[0], x[0])  # position 0 is the identity rotation
    assert not torch.allclose(y[1, :, :8], x[1, :, :8])
    # rotation preserves the norm of each rotated pair (j, j + 4)
    assert torch.allclose(y[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1), atol=1e-5)


def test_unknown_rope_type_is_named():
    with pytest.raises(UnsupportedModelError, match="unsupported rope_scaling type 'longrope'"):
        rope_inv_freq(64, 1e4, {"rope_type": "longrope", "factor": 2.0})
