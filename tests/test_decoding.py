"""Decoding: sampling, schedules and unmasking policies on hand-made tensors with known answers."""

import math

import pytest
import torch

from unmask.decoding import (
    POLICIES,
    BlockState,
    Decision,
    PolicyConfig,
    Proposal,
    SamplingParams,
    decide,
    dream_count,
    even_split,
    propose,
)
from unmask.decoding.policies import entropy_bound_count, factor_count, threshold_mask, top_rows
from unmask.decoding.schedules import dream_reveal_prob

GREEDY = SamplingParams()


def logits_for(probs: list[list[float]]) -> torch.Tensor:
    """Logits whose softmax is exactly the given rows."""
    return torch.tensor(probs, dtype=torch.float32).log()


def binary(p: list[float]) -> torch.Tensor:
    """[M, 2] logits whose top-1 (token 0) has probability p[i]."""
    return logits_for([[x, 1 - x] for x in p])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def prop(probs=None, entropy=None, margin=None) -> Proposal:
    """A hand-made proposal for testing rules directly."""
    ref = next(t for t in (probs, entropy, margin) if t is not None)
    m = len(ref)
    t = lambda v: torch.tensor(v, dtype=torch.float32) if v is not None else torch.zeros(m)
    p = t(probs)
    return Proposal(tokens=torch.arange(m), probs=p, entropy=t(entropy), margin=t(margin), logprobs=p.log())


def rows(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


# ---------------------------------------------------------------------------------------------------- schedules


def test_even_split():
    assert even_split(10, 4) == [3, 3, 2, 2]
    assert even_split(32, 32) == [1] * 32
    assert even_split(3, 5) == [1, 1, 1, 0, 0]
    assert even_split(0, 2) == [0, 0]
    with pytest.raises(ValueError, match="steps"):
        even_split(4, 0)


def test_dream_count():
    # t = linspace(1, 1e-3, steps + 1); n = int(M * (1 - s/t)); last step -> all
    assert [dream_count(10, s, 4) for s in range(4)] == [2, 3, 4, 10]
    assert [dream_count(100, s, 10) for s in range(10)] == [9, 11, 12, 14, 16, 19, 24, 33, 49, 100]
    assert dream_count(32, 0, 32) == 0  # Dream can schedule nothing; policies clamp to 1
    assert dream_count(7, 9, 4) == 7  # past the schedule -> all
    assert dream_reveal_prob(0, 4) == pytest.approx(0.24975, abs=1e-6)
    assert dream_reveal_prob(3, 4) == 1.0


# ---------------------------------------------------------------------------------------------------- sampling


def test_greedy_proposal_is_argmax_with_softmax_stats():
    logits = logits_for([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]) + 7.0  # shift: softmax unchanged
    p = propose(logits, GREEDY, None)
    assert p.tokens.tolist() == [0, 1]
    assert torch.allclose(p.probs, torch.softmax(logits, -1).max(-1).values)
    assert p.probs.tolist() == pytest.approx([0.5, 0.6], abs=1e-6)
    assert p.margin.tolist() == pytest.approx([0.2, 0.3], abs=1e-6)
    h0 = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    assert p.entropy[0].item() == pytest.approx(h0, abs=1e-6)
    assert p.logprobs.tolist() == pytest.approx([math.log(0.5), math.log(0.6)], abs=1e-6)
    assert p.probs.dtype == torch.float32 and p.tokens.dtype == torch.long


def test_greedy_handles_minus_inf_and_ignores_filters():
    logits = torch.tensor([[1.0, float("-inf"), 1.0, 0.0]])
    p = propose(logits, SamplingParams(top_k=1, top_p=0.1), None)
    assert p.tokens.tolist() == [0]  # first of the tied maxima
    e = math.e
    assert p.probs.item() == pytest.approx(e / (2 * e + 1), abs=1e-6)  # full softmax, filters ignored
    assert p.margin.item() == pytest.approx(0.0, abs=1e-7)
    assert not torch.isnan(p.entropy).any()


def test_temperature_rescales_probs():
    logits = logits_for([[0.8, 0.2]] * 400)
    p = propose(logits, SamplingParams(temperature=2.0), gen(0))
    # softmax(log p / 2) = sqrt(p) normalised: [2/3, 1/3]
    expected = {0: 2 / 3, 1: 1 / 3}
    for tok, pr in zip(p.tokens.tolist(), p.probs.tolist()):
        assert pr == pytest.approx(expected[tok], abs=1e-6)
    assert set(p.tokens.tolist()) == {0, 1}
    assert p.margin[0].item() == pytest.approx(1 / 3, abs=1e-6)


def test_top_k_never_samples_outside_top_k():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(4000, 1)
    p = propose(logits, SamplingParams(temperature=1.0, top_k=2), gen(1))
    assert set(p.tokens.tolist()) == {0, 1}
    s = 1 / (1 + math.exp(-1))  # softmax([4, 3]) = [sigmoid(1), 1 - sigmoid(1)]
    assert torch.allclose(p.probs, torch.where(p.tokens == 0, s, 1 - s))
    h = -(s * math.log(s) + (1 - s) * math.log(1 - s))
    assert torch.allclose(p.entropy, torch.full((4000,), h))


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = logits_for([[0.05, 0.5, 0.15, 0.3]]).repeat(4000, 1)
    p = propose(logits, SamplingParams(temperature=1.0, top_p=0.7), gen(2))
    # sorted 0.5, 0.3 | 0.15, 0.05: mass before token 2 is 0.8 >= 0.7 -> dropped; renormalised 0.625 / 0.375
    assert set(p.tokens.tolist()) == {1, 3}
    assert torch.allclose(p.probs, torch.where(p.tokens == 1, 0.625, 0.375))
    assert p.margin[0].item() == pytest.approx(0.25, abs=1e-6)


def test_top_k_then_top_p():
    logits = logits_for([[0.4, 0.3, 0.2, 0.1]]).repeat(2000, 1)
    # top-k 3 -> [4/9, 3/9, 2/9]; top-p 0.5 -> mass before token 1 is 4/9 < 0.5, before token 2 is 7/9 -> keep 0, 1
    p = propose(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5), gen(3))
    assert set(p.tokens.tolist()) == {0, 1}
    assert torch.allclose(p.probs, torch.where(p.tokens == 0, 4 / 7, 3 / 7))


def test_sampling_is_reproducible_by_seed():
    flat = torch.zeros(256, 1000)
    params = SamplingParams(temperature=1.0)
    a = propose(flat, params, gen(0)).tokens
    b = propose(flat, params, gen(0)).tokens
    c = propose(flat, params, gen(1)).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.allclose(propose(flat, params, gen(0)).probs, torch.full((256,), 1e-3))


def test_propose_empty_rows():
    p = propose(torch.zeros(0, 5), SamplingParams(temperature=1.0), gen(0))
    assert p.tokens.shape == (0,) and p.probs.shape == (0,)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


# ---------------------------------------------------------------------------------------------------- rule primitives


def test_threshold_rule():
    assert rows(threshold_mask(torch.tensor([0.95, 0.5, 0.92]), 0.9)) == [0, 2]
    assert rows(threshold_mask(torch.tensor([0.6, 0.8, 0.7]), 0.9)) == [1]  # none pass -> only the best
    assert rows(threshold_mask(torch.tensor([0.9, 0.3]), 0.9)) == [0]  # >= is inclusive


def test_factor_rule():
    # sorted [0.9, 0.8, 0.7, 0.6]; thresholds 1 - 1/(i+1): i=2 -> 0.667 ok (0.8), i=3 -> 0.75 fails (0.7)
    conf = torch.tensor([0.9, 0.7, 0.8, 0.6])
    assert factor_count(conf, 1.0) == 2
    d = POLICIES["factor"](PolicyConfig(name="factor"), prop(probs=[0.9, 0.7, 0.8, 0.6]), BlockState(4), None)
    assert rows(d) == [0, 2]
    # i=2: 0.667, i=3: 0.75, i=4: 0.8 -> all pass
    assert factor_count(torch.tensor([0.99, 0.95, 0.9, 0.85]), 1.0) == 4
    # f = 0.1: i=2 needs 1 - 0.1/3 = 0.967 -> 0.95 fails; the first is always taken
    assert factor_count(torch.tensor([0.99, 0.95, 0.9, 0.85]), 0.1) == 1
    assert factor_count(torch.tensor([0.2, 0.1]), 1.0) == 1


def test_entropy_bound_rule():
    h = [0.1, 0.3, 0.05, 0.2]
    # ascending [0.05, 0.1, 0.2, 0.3]: sum - max per prefix = [0, 0.05, 0.15, 0.35] -> k = 3 at bound 0.3
    assert entropy_bound_count(torch.tensor(h), 0.3) == 3
    assert entropy_bound_count(torch.tensor(h), 0.1) == 2
    assert entropy_bound_count(torch.tensor(h), 0.0) == 1
    cfg = PolicyConfig(name="entropy_bounded", entropy_bound=0.3)
    assert rows(POLICIES["entropy_bounded"](cfg, prop(entropy=h), BlockState(4), None)) == [0, 2, 3]


def test_top_rows_breaks_ties_by_position():
    assert rows(top_rows(torch.tensor([0.5, 0.7, 0.7, 0.7]), 2)) == [1, 2]


# ------------------------------------------------------------------------------------------------ policies via decide


def run(cfg, logits, state=None, sampling=GREEDY, generator=None, positions=None) -> Decision:
    state = state if state is not None else BlockState(initial_masked=logits.shape[0])
    positions = positions if positions is not None else torch.arange(logits.shape[0])
    return decide(cfg, logits, positions, state, sampling, generator)


def test_threshold_policy_via_decide():
    d = run(PolicyConfig(name="threshold", threshold=0.9), binary([0.95, 0.5, 0.92]))
    assert rows(d.commit) == [0, 2]
    assert d.tokens.tolist() == [0, 0, 0]
    assert d.probs.tolist() == pytest.approx([0.95, 0.5, 0.92], abs=1e-6)
    assert rows(run(PolicyConfig(name="threshold"), binary([0.6, 0.8, 0.7])).commit) == [1]


def test_low_confidence_schedule_over_a_block():
    # 10 masks, 4 steps -> 3, 3, 2, 2; always the most confident first
    cfg = PolicyConfig(name="low_confidence", steps=4)
    conf = torch.tensor([0.55, 0.9, 0.6, 0.8, 0.65, 0.95, 0.7, 0.85, 0.75, 0.51])
    state = BlockState(initial_masked=10)
    masked = torch.ones(10, dtype=torch.bool)
    order, counts = [], []
    while masked.any():
        idx = masked.nonzero().flatten()
        d = decide(cfg, binary(conf[idx].tolist()), idx, state, GREEDY, None)
        done = idx[d.commit]
        counts.append(len(done))
        order.append(sorted(done.tolist()))
        masked[done] = False
    assert counts == [3, 3, 2, 2] and sum(counts) == 10
    assert order == [[1, 5, 7], [3, 6, 8], [2, 4], [0, 9]]
    assert state.step == 4


def test_low_confidence_last_step_commits_all_and_default_steps():
    state = BlockState(initial_masked=10, step=3)
    d = run(PolicyConfig(name="low_confidence", steps=4), binary([0.6, 0.7, 0.8, 0.9, 0.55]), state)
    assert d.commit.all()
    # steps=None -> one step per initially masked token -> one commit per step
    d = run(PolicyConfig(name="low_confidence"), binary([0.6, 0.7, 0.8]))
    assert rows(d.commit) == [2]


def test_random_policy_quota_and_seed():
    cfg = PolicyConfig(name="random", steps=4)
    logits = binary([0.6] * 10)
    a = run(cfg, logits, generator=gen(0)).commit
    b = run(cfg, logits, generator=gen(0)).commit
    assert int(a.sum()) == 3 and torch.equal(a, b)
    picks = {tuple(rows(run(cfg, logits, generator=gen(s)).commit)) for s in range(8)}
    assert len(picks) > 1  # positions depend on the seed, not on confidence


def test_dream_confidence_kinds():
    # M = 10, steps 4, step 0 -> n = 2 by Dream's schedule
    p = prop(probs=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05],
             margin=[0.1, 0.2, 0.9, 0.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
             entropy=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.1, 1.0, 0.2, 1.0])
    state = BlockState(initial_masked=10)
    assert rows(POLICIES["maskgit_plus"](PolicyConfig(name="maskgit_plus", steps=4), p, state, None)) == [0, 1]
    assert rows(POLICIES["topk_margin"](PolicyConfig(name="topk_margin", steps=4), p, state, None)) == [2, 3]
    assert rows(POLICIES["entropy"](PolicyConfig(name="entropy", steps=4), p, state, None)) == [6, 8]
    # Dream would schedule 0 tokens at step 0 of 32 with 32 masks: clamped to one
    p32 = prop(probs=[0.5] * 31 + [0.9])
    cfg32 = PolicyConfig(name="maskgit_plus", steps=32)
    assert rows(POLICIES["maskgit_plus"](cfg32, p32, BlockState(32), None)) == [31]
    # last step -> all
    assert POLICIES["entropy"](PolicyConfig(name="entropy", steps=4), p, BlockState(10, step=3), None).all()


def test_dream_alg_temp_samples_positions_reproducibly():
    cfg = PolicyConfig(name="maskgit_plus", steps=4, alg_temp=1.0)
    p = prop(probs=[0.5] * 10)
    a = POLICIES["maskgit_plus"](cfg, p, BlockState(10), gen(0))
    b = POLICIES["maskgit_plus"](cfg, p, BlockState(10), gen(0))
    assert int(a.sum()) == 2 and torch.equal(a, b)
    picks = {tuple(rows(POLICIES["maskgit_plus"](cfg, p, BlockState(10), gen(s)))) for s in range(8)}
    assert len(picks) > 1


def test_origin_reveals_at_random_but_never_nothing():
    cfg = PolicyConfig(name="origin", steps=4)
    many = prop(probs=[0.5] * 4000)
    frac = POLICIES["origin"](cfg, many, BlockState(4000), gen(0)).float().mean().item()
    assert 0.22 < frac < 0.28  # 1 - s/t = 0.24975 at step 0 of 4
    tiny = PolicyConfig(name="origin", steps=1000)  # p ~ 1e-3 per row: usually nothing drawn -> exactly one forced
    assert int(POLICIES["origin"](tiny, prop(probs=[0.5] * 3), BlockState(3), gen(0)).sum()) == 1
    assert POLICIES["origin"](cfg, prop(probs=[0.5] * 5), BlockState(5, step=3), gen(0)).all()


def test_topk_policy():
    logits = binary([0.6, 0.9, 0.7, 0.8])
    assert rows(run(PolicyConfig(name="topk"), logits).commit) == [1]  # None -> one per step
    assert rows(run(PolicyConfig(name="topk", tokens_per_step=2), logits).commit) == [1, 3]
    assert run(PolicyConfig(name="topk", tokens_per_step=8), logits).commit.all()


def test_credit_accumulates_across_calls():
    cfg = PolicyConfig(name="credit", threshold=0.91)
    logits = binary([0.99, 0.85])
    state = BlockState(initial_masked=2)
    c85, c99 = 0.85 ** 0.2, 0.99 ** 0.2

    d1 = run(cfg, logits, state)
    assert state.credit.pos.tolist() == [0, 1] and state.credit.tok.tolist() == [0, 0]
    assert state.credit.val.tolist() == pytest.approx([c99, c85], abs=1e-6)
    # fused logit of token 0 = logit + 0.7 * log(1 + C): p(row 1) 0.85 -> 0.9010 < 0.91
    assert d1.probs[1].item() == pytest.approx(0.9010120, abs=1e-5)
    assert rows(d1.commit) == [0]

    d2 = run(cfg, logits, state)
    assert state.credit.val.tolist() == pytest.approx([1.8 * c99, 1.8 * c85], abs=1e-5)  # 0.8 * C + p^0.2
    assert d2.probs[1].item() == pytest.approx(0.9198856, abs=1e-5)
    assert rows(d2.commit) == [0, 1]  # credit alone pushed row 1 over the threshold
    assert state.step == 2


def test_credit_keeps_one_entry_per_position_token_and_drops_committed_rows():
    cfg = PolicyConfig(name="credit")
    state = BlockState(initial_masked=3)
    run(cfg, binary([0.99, 0.85, 0.7]), state, positions=torch.tensor([0, 1, 2]))
    # position 0 committed; position 2's top-1 flips to token 1 with p = 0.6
    run(cfg, binary([0.85, 0.4]), state, positions=torch.tensor([1, 2]))
    got = sorted(zip(state.credit.pos.tolist(), state.credit.tok.tolist(), state.credit.val.tolist()))
    want = [(1, 0, 1.8 * 0.85 ** 0.2), (2, 0, 0.8 * 0.7 ** 0.2), (2, 1, 0.6 ** 0.2)]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want], abs=1e-5)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_empty_nonempty_and_deterministic(name):
    cfg = PolicyConfig(name=name, steps=8, tokens_per_step=2, alg_temp=0.5 if name == "entropy" else 0.0)
    empty = BlockState(initial_masked=4)
    d = run(cfg, torch.zeros(0, 11), empty, positions=torch.zeros(0, dtype=torch.long))
    assert d.commit.shape == (0,) and d.tokens.shape == (0,) and empty.step == 1

    logits = torch.randn(6, 11, generator=gen(5)) * 3
    for sampling in (GREEDY, SamplingParams(temperature=0.8, top_k=5, top_p=0.9)):
        a = run(cfg, logits, BlockState(initial_masked=16), sampling, gen(7))
        b = run(cfg, logits, BlockState(initial_masked=16), sampling, gen(7))
        assert a.commit.any()
        assert torch.equal(a.commit, b.commit) and torch.equal(a.tokens, b.tokens)
        assert a.commit.dtype == torch.bool and a.tokens.dtype == torch.long and a.probs.dtype == torch.float32


def test_policy_config_validation():
    with pytest.raises(ValueError, match="unknown decoding policy 'nope'.*low_confidence"):
        PolicyConfig(name="nope")
    for field, bad in [("threshold", 0.0), ("threshold", 1.5), ("factor", 0.0), ("steps", 0),
                       ("entropy_bound", -0.1), ("alg_temp", -1.0), ("credit_decay", 1.5),
                       ("credit_gamma", 0.0), ("credit_weight", -1.0), ("tokens_per_step", 0)]:
        with pytest.raises(ValueError, match=field):
            PolicyConfig(**{field: bad})
    with pytest.raises(ValueError, match="positions"):
        run(PolicyConfig(), binary([0.5, 0.6]), positions=torch.arange(3))
