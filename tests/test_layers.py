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


# ---------------------------------------------------------------- RMSNorm and RoPE against the plain formulas

def _rms_norm_formula(x, weight, eps):
    """The layer before the fused kernel: normalise in float32, cast to x's dtype, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope_formula(x, cos, sin, r):
    """rotate_half RoPE as written before (float32 copy of x, rotated copy, full-width tables)."""
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)   # cos_sin's half tables, as both halves
    xr, half = x[..., :r].float(), r // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = (xr * cos[..., None, :] + rotated * sin[..., None, :]).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_the_float32_formula(dtype):
    from unmask.models.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(3, 50, 256, generator=g) * 4).to(dtype)
    x[0, 0] = 0.0  # eps alone in the denominator
    with torch.no_grad():
        out, ref = norm(x), _rms_norm_formula(x, norm.weight, norm.eps)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=2e-6, atol=1e-7)
    else:  # the normalised value is rounded once to dtype either way: at most one rounding step apart
        assert (out.float() - ref.float()).abs().max() <= 2 * torch.finfo(dtype).eps * ref.float().abs().max()
        assert (out != ref).float().mean() < 0.01
    # the CUDA branch's torch.nn.functional.rms_norm computes the same normalisation
    fused = norm.weight * torch.nn.functional.rms_norm(x.float(), (256,), eps=norm.eps).to(dtype)
    assert torch.allclose(out.float(), fused.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


def test_rms_norm_gradients_equal_the_formula():
    """Training runs the layer under autograd: same values and gradients as the plain formula."""
    from unmask.models.layers import RMSNorm

    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    x = torch.randn(4, 9, 64, generator=g, requires_grad=True)
    up = torch.randn(4, 9, 64, generator=g)
    (norm(x) * up).sum().backward()
    gx, gw = x.grad.clone(), norm.weight.grad.clone()
    x.grad, norm.weight.grad = None, None
    (_rms_norm_formula(x, norm.weight, norm.eps) * up).sum().backward()
    assert torch.allclose(gx, x.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(gw, norm.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim,scaling", [(32, None), (16, None), (32, {"rope_type": "yarn", "factor": 4.0,
                                                                           "original_max_position_embeddings": 64})])
def test_rope_equals_the_rotate_half_formula(dtype, rotary_dim, scaling):
    """The in-place product form against the rotate_half formula, ragged [N, H, D] and dense [B, L, H, D], partial
    rotary and YaRN's magnitude included; equal in float32 to rounding, within one rounding step in bfloat16."""
    rope = Rotary(head_dim=32, theta=10000.0, rotary_dim=rotary_dim, scaling=scaling)
    g = torch.Generator().manual_seed(rotary_dim)
    positions = torch.randint(0, 5000, (2, 40), generator=g)
    x = (torch.randn(2, 40, 4, 32, generator=g) * 3).to(dtype)
    cos, sin = rope.cos_sin(positions)
    # the tables: the cos/sin of the (float32) angles times the magnitude, once for both halves
    freqs = (positions.float()[..., None] * rope.inv_freq).double()
    assert cos.shape == (2, 40, rotary_dim // 2)
    assert torch.allclose(cos.double(), freqs.cos() * rope.mscale, atol=2e-6)
    assert torch.allclose(sin.double(), freqs.sin() * rope.mscale, atol=2e-6)
    for xs, c, s in ((x, cos, sin), (x[0], cos[0], sin[0])):
        with torch.no_grad():
            out, ref = rope.apply(xs, c, s), _rope_formula(xs, c, s, rotary_dim)
        assert out.dtype == dtype and out.shape == xs.shape
        if dtype == torch.float32:
            assert torch.allclose(out, ref, rtol=1e-6, atol=1e-5)
        else:
            assert (out.float() - ref.float()).abs().max() <= 2 * torch.finfo(dtype).eps * ref.float().abs().max()
            assert (out != ref).float().mean() < 0.01
        assert torch.equal(out[..., rotary_dim:], xs[..., rotary_dim:])


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_tables_are_the_computed_angles_bit_for_bit(scaling):
    """The CPU table (grown to the farthest position seen, past its first size too) gives exactly the values
    computed per call, ragged and dense, so a model reads the same cos/sin either way."""
    rope = Rotary(head_dim=32, theta=10000.0, scaling=scaling)
    for positions in (torch.arange(7), torch.tensor([5, 300, 2, 299]), torch.arange(4000).view(8, 500),
                      torch.tensor([[70000, 3]])):
        cos, sin = rope.cos_sin(positions)
        want_cos, want_sin = rope._angles(positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rope._table[0].shape == (131072, 16)   # grown to a power of two past 70,000
    assert rope.cos_sin(torch.empty(0, dtype=torch.long))[0].shape == (0, 16)


def test_rope_gradients_equal_the_formula():
    rope = Rotary(head_dim=16, theta=10000.0)
    g = torch.Generator().manual_seed(2)
    cos, sin = rope.cos_sin(torch.arange(7)[None])
    x = torch.randn(1, 7, 2, 16, generator=g, requires_grad=True)
    up = torch.randn(1, 7, 2, 16, generator=g)
    out = rope.apply(x, cos, sin)
    (out * up).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    ref = _rope_formula(x, cos, sin, 16)
    (ref * up).sum().backward()
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(grad, x.grad, atol=1e-5)
