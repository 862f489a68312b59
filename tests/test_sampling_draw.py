"""The per-row categorical draw every sampled token goes through (decoding.sampling._multinomial, inverse CDF)."""
import torch

from unmask.decoding.sampling import _multinomial


def test_draw_frequencies_follow_each_rows_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0], [0.1, 0.6, 0.0, 0.3]])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.zeros_like(probs)
    for _ in range(n // 1000):  # 1,000 draws per call: rows stacked
        draws = _multinomial(probs.repeat(1000, 1), g).view(1000, 3)
        for r in range(3):
            counts[r] += torch.bincount(draws[:, r], minlength=4)
    freq = counts / n
    # 4 standard errors of a proportion at n = 20,000 is under 0.015
    assert torch.allclose(freq, probs, atol=0.015), freq
    assert counts[0, 1] == 0 and counts[1, :3].sum() == 0 and counts[2, 2] == 0  # zero mass: never drawn


def test_draws_repeat_with_the_seed_and_take_one_uniform_per_row():
    probs = torch.softmax(torch.randn(7, 50_000), -1)
    a = _multinomial(probs, torch.Generator().manual_seed(3))
    b = _multinomial(probs, torch.Generator().manual_seed(3))
    assert a.shape == (7,) and a.dtype == torch.long and torch.equal(a, b)
    g = torch.Generator().manual_seed(3)
    _multinomial(probs, g)
    after = torch.rand(1, generator=g)
    g2 = torch.Generator().manual_seed(3)
    torch.rand(7, 1, generator=g2)
    assert torch.equal(after, torch.rand(1, generator=g2))  # the stream moved by exactly 7 uniforms


def test_unnormalised_rows_and_a_last_token_with_all_the_mass():
    probs = torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 1e-30]])  # rows need not sum to 1 (filtered supports)
    draws = torch.stack([_multinomial(probs, torch.Generator().manual_seed(s)) for s in range(200)])
    assert set(draws[:, 0].tolist()) == {0, 1} and set(draws[:, 1].tolist()) == {2}


def test_row_argmax_is_torch_argmax_with_ties_nan_views_and_other_dtypes():
    from unmask.decoding.sampling import row_argmax

    x = torch.randn(10, 8192)
    x[3, 7] = x[3, 4000] = 1e4           # a tie: the first maximum, as torch's
    x[5, 9] = float("nan")                # NaN is the maximum, as torch's
    x[6] = float("-inf")
    for t in (x, x[:, ::2], x.t().contiguous().t(), x[0], x[:0], x.bfloat16(), x.double()):
        got, want = row_argmax(t), t.argmax(dim=-1)
        assert got.dtype == torch.long and got.shape == want.shape and torch.equal(got, want)
    assert row_argmax(x)[3] == 7 and row_argmax(x)[5] == 9 and row_argmax(x)[6] == 0


def test_an_unseeded_request_leaves_the_global_generator_alone():
    from unmask.defaults import default_model_path
    from unmask.engine.engine import Engine
    from unmask.engine.params import GenerationParams
    from unmask.models.loader import load_model

    model, spec = load_model(default_model_path(), dtype="float32")
    engine = Engine(model, spec, max_num_seqs=1)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = engine.add_request([5, 6, 7], GenerationParams(max_tokens=2, temperature=1.0))
    b = engine.add_request([5, 6, 7], GenerationParams(max_tokens=2, temperature=1.0))
    assert torch.equal(torch.rand(3), expected)
    assert a.generator.initial_seed() != b.generator.initial_seed()   # each request its own fresh seed
    c = engine.add_request([5, 6, 7], GenerationParams(max_tokens=2, temperature=1.0, seed=42))
    assert c.generator.initial_seed() == 42
