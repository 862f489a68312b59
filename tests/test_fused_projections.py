"""q/k/v and gate/up as one packed oneDNN product on the CPU (models/cpu_linear.FusedProjection): the numbers of
the separate linears, refreshed when a member's weight changes, out of autograd's way, never on a draft adapter's
linears, and the engine's tokens unchanged."""
import pytest
import torch

from unmask.models.cpu_linear import FUSED_GROUPS, FusedProjection, pack_linears, packed_linear_available
from unmask.models.draft_adapter import DraftAdapterConfig
from unmask.models.transformer import ArchConfig, DiffusionTransformer

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN linear")


def _model(dtype=torch.float32, **arch) -> DiffusionTransformer:
    torch.manual_seed(0)
    cfg = ArchConfig(vocab_size=300, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                     intermediate_size=384, max_position=512, **arch)
    model = DiffusionTransformer(cfg).to(dtype).eval().requires_grad_(False)
    for p in model.parameters():   # biases and norms away from their 0 / 1 init, so each one is exercised
        p.add_(torch.randn_like(p) * 0.05)
    return model


def _unfused(model: DiffusionTransformer) -> None:
    for module in model.modules():
        for name in FUSED_GROUPS:
            module.__dict__.pop(name, None)


def _hidden(model, ids, mask="causal"):
    pos = torch.arange(ids.shape[-1]).expand_as(ids)
    with torch.no_grad():
        return model.forward_dense(ids, pos, mask)


@pytest.mark.parametrize("arch", [{}, {"qkv_bias": True}, {"qk_norm": True, "partial_rotary": 0.5}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_equals_the_separate_linears(arch, dtype):
    model = _model(dtype, **arch)
    assert pack_linears(model) == 7 * 2 + 1
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.fused_qkv, FusedProjection) and isinstance(layer.mlp.fused_gate_up,
                                                                                  FusedProjection)
    assert layer.self_attn.fused_qkv.widths == [128, 64, 64] and layer.mlp.fused_gate_up.widths == [384, 384]
    assert all(m._pack is None for m in (layer.self_attn.q_proj, layer.mlp.up_proj))  # one packed copy, the fused
    ids = torch.randint(4, 300, (2, 24))
    fused = _hidden(model, ids)
    _unfused(model)
    separate = _hidden(model, ids)
    assert fused.shape == (2, 24, 128) and fused.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused.float(), separate.float(), rtol=tol, atol=tol)


def test_a_member_weight_that_changes_is_fused_again():
    model = _model()
    pack_linears(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(12, 128)   # 12 x 256 x 128: over PACK_MIN_WORK, so the fused path runs
    with torch.no_grad():
        before = attn.fused_qkv(x)
        attn.k_proj.weight.mul_(2)                                            # in place: the version moves
        doubled = attn.fused_qkv(x)
        attn.v_proj.weight = torch.nn.Parameter(torch.zeros(64, 128), requires_grad=False)   # replaced
        zeroed = attn.fused_qkv(x)
    torch.testing.assert_close(doubled[:, 128:192], 2 * before[:, 128:192], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(doubled[:, :128], before[:, :128])
    assert float(zeroed[:, 192:].abs().max()) == 0.0


def test_autograd_and_tiny_float32_products_take_the_separate_linears():
    model = _model()
    pack_linears(model)
    attn = model.model.layers[0].self_attn
    assert attn.fused_qkv(torch.randn(1, 128)) is None      # 1 row x 256 x 128 weights: under PACK_MIN_WORK (MKL)
    assert attn.fused_qkv(torch.randn(12, 128)).shape == (12, 256)
    model.requires_grad_(True)
    x = torch.randn(12, 128, requires_grad=True)
    assert attn.fused_qkv(x) is None
    ids = torch.randint(4, 300, (1, 10))
    model.logits(model.forward_dense(ids, torch.arange(10)[None], "causal")).sum().backward()
    assert attn.q_proj.weight.grad is not None and model.model.layers[1].mlp.gate_proj.weight.grad is not None


def test_a_draft_adapters_linears_are_never_fused():
    model = _model()
    model.enable_draft_adapter(DraftAdapterConfig(rank=4, alpha=8.0, mask_id=3))
    pack_linears(model)
    assert not any(name in m.__dict__ for m in model.modules() for name in FUSED_GROUPS)


def test_the_engine_writes_the_same_tokens_fused_and_not():
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams

    llm = LLM(dtype="float32")
    groups = sum(name in m.__dict__ for m in llm.model.modules() for name in FUSED_GROUPS)
    assert groups == 2 * llm.model.cfg.num_layers
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n"]
    params = [GenerationParams(max_tokens=24, policy="speculative", block_size=4, draft_lookup=8),
              GenerationParams(max_tokens=24, policy="threshold", threshold=0.9)]
    fused = [[o.token_ids for o in llm.generate(prompts, [gp] * 3)] for gp in params]
    _unfused(llm.model)
    separate = [[o.token_ids for o in llm.generate(prompts, [gp] * 3)] for gp in params]
    assert fused == separate and all(len(t) > 0 for runs in fused for t in runs)


def test_a_member_bias_written_in_place_is_fused_again():
    model = _model(qkv_bias=True)
    pack_linears(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(12, 128)
    with torch.no_grad():
        before = attn.fused_qkv(x)
        attn.q_proj.bias.add_(1.0)
        after = attn.fused_qkv(x)
    torch.testing.assert_close(after[:, :128], before[:, :128] + 1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[:, 128:], before[:, 128:])
