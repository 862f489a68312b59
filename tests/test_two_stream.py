"""Block-diffusion training attention without the dense [2L, 2L] mask (models/two_stream.py) against the dense
mask it replaces: the same outputs and gradients, and the same loss and parameter gradients through a model."""
import pytest
import torch
import torch.nn.functional as F

from unmask.models.two_stream import CHUNK, TwoStreamLayout, two_stream_attention, use_two_stream
from unmask.train.objectives import Noise, Objective, _build_bd_mask, diffusion_loss_sum


@pytest.mark.parametrize("causal_context", [True, False])
@pytest.mark.parametrize("length,block,chunk", [(40, 4, 16), (37, 8, 16), (64, 16, 16), (24, 8, 64)])
def test_split_attention_matches_the_dense_mask(causal_context, length, block, chunk):
    gen = torch.Generator().manual_seed(length + block)
    q, k, v = (torch.randn(2, 4, 2 * length, 16, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    weight = torch.randn(2, 4, 2 * length, 16, generator=gen, dtype=torch.float64)
    layout = TwoStreamLayout(length, block, causal_context, chunk=chunk)
    assert layout.chunk % block == 0
    split = two_stream_attention(q, k, v, layout)
    grads = torch.autograd.grad((split * weight).sum(), (q, k, v))
    mask = _build_bd_mask(length, block, causal_context, torch.device("cpu"))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expect = torch.autograd.grad((dense * weight).sum(), (q, k, v))
    assert split.shape == dense.shape == (2, 4, 2 * length, 16)
    torch.testing.assert_close(split, dense, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expect):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_masks_are_built_once_per_layout():
    layout = TwoStreamLayout(48, 8, True, chunk=16)
    first = layout.mask("noisy", 16, 32, torch.device("cpu"))
    assert layout.mask("noisy", 16, 32, torch.device("cpu")) is first
    # rows 16..31 see the clean rows of earlier blocks (0..15 and, for block 3, 16..23) and their own noisy block
    assert first.shape == (16, 32 + 16)
    assert first[0, :16].all() and not first[0, 16:32].any() and first[0, 32:40].all() and not first[0, 40:].any()
    assert first[8, :24].all() and not first[8, 24:32].any() and first[8, 40:].all()


def test_short_rows_keep_the_dense_mask():
    assert not use_two_stream(512, 8) and not use_two_stream(CHUNK, 32)
    assert use_two_stream(CHUNK + 8, 8) and use_two_stream(16384, 32)


def test_loss_and_gradients_through_a_model_match_the_dense_path(monkeypatch):
    """A row longer than CHUNK takes the split path in `diffusion_loss_sum`; forced onto the dense mask, the same
    model, batch and noise give the same loss and parameter gradients."""
    import unmask.train.objectives as objectives
    from unmask.models.transformer import ArchConfig, DiffusionTransformer

    torch.manual_seed(0)
    cfg = ArchConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_position=4096)
    model = DiffusionTransformer(cfg)  # float32: the norms compute in it
    L, block = CHUNK + 96, 8
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randint(4, 64, (1, L), generator=gen)
    masked = torch.rand(1, L, generator=gen) < 0.4
    noise = Noise(block, masked, torch.full((1, L), 0.4))
    obj = Objective(mask_id=3, block_sizes=(block,), shift=True, causal_context=True, next_token_weight=1.0,
                    vocab_size=64)
    eligible = torch.ones(1, L, dtype=torch.bool)
    eligible[:, 0] = False

    def loss_and_grads():
        model.zero_grad()
        loss = diffusion_loss_sum(model, x0, noise, obj, eligible)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    calls = []
    real = objectives.use_two_stream
    monkeypatch.setattr(objectives, "use_two_stream", lambda *a: calls.append(a) or real(*a))
    split_loss, split_grads = loss_and_grads()
    assert calls == [(L, block)] and real(L, block)
    monkeypatch.setattr(objectives, "use_two_stream", lambda *a: False)
    dense_loss, dense_grads = loss_and_grads()
    torch.testing.assert_close(split_loss, dense_loss, rtol=1e-6, atol=1e-5)
    for got, want in zip(split_grads, dense_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
