"""The oneDNN packed-weight CPU linear (models/cpu_linear.py): same numbers as F.linear, refreshed when the weight
changes, out of autograd's way, and the engine's tokens unchanged by it."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unmask.models.cpu_linear import PackedLinear, pack_linears, packed_linear_available

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN linear")


def _packed(out_f: int, in_f: int, bias: bool, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    assert pack_linears(nn.Sequential(lin)) == 1
    assert type(lin) is PackedLinear
    return lin


@pytest.mark.parametrize("rows", [1, 4, 10, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_in_float32(rows, bias):
    lin = _packed(1024, 256, bias)
    x = torch.randn(rows, 256)
    with torch.no_grad():
        got = lin(x)
        want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == (rows, 1024) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_linear_in_bfloat16_and_over_leading_dims():
    lin = _packed(512, 128, True, torch.bfloat16)
    x = torch.randn(2, 7, 128).bfloat16()
    with torch.no_grad():
        got = lin(x)
        want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert got.shape == (2, 7, 512) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_a_changed_weight_is_packed_again():
    lin = _packed(1024, 256, False)
    x = torch.randn(8, 256)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2)  # in place: the version counter moves
        doubled = lin(x)
        lin.weight = nn.Parameter(torch.zeros(1024, 256), requires_grad=False)  # replaced: the pointer moves
        zero = lin(x)
    torch.testing.assert_close(doubled, 2 * before, rtol=1e-5, atol=1e-5)
    assert float(zero.abs().max()) == 0.0


def test_autograd_runs_the_plain_linear_and_gets_gradients():
    lin = _packed(1024, 256, True)
    lin.requires_grad_(True)
    x = torch.randn(8, 256, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(8, -1), rtol=1e-5, atol=1e-4)
    assert lin.bias.grad is not None and torch.equal(lin.bias.grad, torch.full((1024,), 8.0))


def test_pack_linears_leaves_the_model_alone_when_switched_off_or_too_big(monkeypatch):
    model = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256))
    keys = list(model.state_dict())
    assert pack_linears(model, max_bytes=1000) == 0  # 2 x 1 MB of weights: over the cap
    assert all(type(m) is nn.Linear for m in model)
    monkeypatch.setenv("UNMASK_ONEDNN_LINEAR", "0")
    assert pack_linears(model) == 0
    monkeypatch.delenv("UNMASK_ONEDNN_LINEAR")
    assert pack_linears(model) == 2
    assert list(model.state_dict()) == keys  # same parameters, same names: checkpoints save and load unchanged


def test_subclasses_of_linear_are_not_swapped():
    class Special(nn.Linear):
        pass

    model = nn.Sequential(Special(256, 256), nn.Linear(256, 256))
    assert pack_linears(model) == 1
    assert type(model[0]) is Special and type(model[1]) is PackedLinear


def test_the_engine_writes_the_same_tokens_with_and_without_packed_linears(monkeypatch):
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams

    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n"]
    params = [GenerationParams(max_tokens=24, policy="speculative", block_size=4, draft_lookup=8),
              GenerationParams(max_tokens=24, policy="threshold", threshold=0.9)]
    packed = LLM(dtype="float32")
    n_linears = sum(type(m) is PackedLinear for m in packed.model.modules())
    cfg = packed.model.cfg
    assert packed.packed_linears == n_linears == 7 * cfg.num_layers + 1  # q k v o gate up down per layer + head
    monkeypatch.setenv("UNMASK_ONEDNN_LINEAR", "0")
    plain = LLM(dtype="float32")
    assert plain.packed_linears == 0
    for gp in params:
        a = [o.token_ids for o in packed.generate(prompts, [gp] * len(prompts))]
        b = [o.token_ids for o in plain.generate(prompts, [gp] * len(prompts))]
        assert a == b and all(len(t) > 0 for t in a)


def test_a_packed_path_that_fails_its_check_leaves_every_linear_plain(monkeypatch):
    import unmask.models.cpu_linear as cl

    def broken(*args):
        raise RuntimeError("no oneDNN kernel for this dtype here")

    monkeypatch.setattr(cl, "_check", broken)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256))
    assert pack_linears(model) == 0
    assert all(type(m) is nn.Linear and m._pack is None for m in model)
    x = torch.randn(8, 256)
    with torch.no_grad():
        torch.testing.assert_close(model(x), F.linear(F.linear(x, model[0].weight, model[0].bias),
                                                      model[1].weight, model[1].bias))


def test_load_model_packs_on_the_cpu_unless_asked_not_to():
    from unmask.defaults import default_model_path
    from unmask.models.loader import load_model

    packed, _ = load_model(default_model_path(), dtype="float32")
    plain, _ = load_model(default_model_path(), dtype="float32", packed_linears=False)
    assert sum(type(m) is PackedLinear for m in packed.modules()) == 7 * packed.cfg.num_layers + 1
    assert not any(type(m) is PackedLinear for m in plain.modules())
    ids, pos = torch.arange(5, 25), torch.arange(20)
    with torch.no_grad():
        a = packed.logits(packed.forward_dense(ids[None], pos[None], "causal")[0])
        b = plain.logits(plain.forward_dense(ids[None], pos[None], "causal")[0])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _ran_onednn(lin: nn.Linear, x: torch.Tensor, grad: bool = False) -> bool:
    from torch.profiler import ProfilerActivity, profile

    with torch.set_grad_enabled(grad), profile(activities=[ProfilerActivity.CPU]) as prof:
        lin(x)
    return any("_linear_pointwise" in e.key for e in prof.key_averages())


def test_the_routing_rule_sends_small_float32_products_to_mkl_and_the_rest_to_onednn():
    small = _packed(256, 256, False)                 # 65,536 weights: 1-4 rows stay on MKL (PACK_MIN_WORK)
    assert not _ran_onednn(small, torch.randn(1, 256))
    assert _ran_onednn(small, torch.randn(10, 256))
    head = _packed(8192, 256, False)
    assert _ran_onednn(head, torch.randn(1, 256))    # the LM head: oneDNN from one row on
    bf16 = _packed(256, 256, False, torch.bfloat16)
    assert _ran_onednn(bf16, torch.randn(1, 256).bfloat16())  # bfloat16: always
    head.requires_grad_(True)
    assert not _ran_onednn(head, torch.randn(10, 256), grad=True)  # autograd: F.linear
