"""logit_bias / presence_penalty / frequency_penalty: the arithmetic, the engine hook, the server fields."""
from __future__ import annotations

import pytest
import torch

from unmask.decoding.logit_adjust import Adjuster, LogitAdjust, ban_early_stops, validate
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError


def test_adjust_arithmetic():
    a = Adjuster(LogitAdjust(bias=((1, 5.0), (3, -2.0)), presence_penalty=0.5, frequency_penalty=0.25))
    a.commit(torch.tensor([2, 2, 3]))          # before the first step: held until V is known
    out = a.adjust(torch.zeros(2, 5))
    # token 1: +5; token 2: count 2 -> -0.5 - 0.5; token 3: -2 - 0.5 - 0.25
    assert out.tolist() == [[0.0, 5.0, -1.0, -2.75, 0.0]] * 2
    a.commit(torch.tensor([0]))
    assert a.adjust(torch.zeros(1, 5)).tolist() == [[-0.75, 5.0, -1.0, -2.75, 0.0]]
    assert validate({3: 100.0}, 2.0, -2.0) is None
    assert "presence_penalty must be in [-2, 2]" in validate(None, 2.5, 0.0)
    assert "logit_bias values must be in [-100, 100]" in validate({3: 101.0}, 0.0, 0.0)
    assert "logit_bias keys must be token ids" in validate({"x": 1.0}, 0.0, 0.0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    a = Adjuster(LogitAdjust(repetition_penalty=2.0, frequency_penalty=0.5), prompt_ids=[1, 1, 9])  # 9: not in V
    a.commit(torch.tensor([3]))
    out = a.adjust(torch.tensor([[4.0, 4.0, 4.0, -4.0, -4.0], [0.0, -1.0, 0.0, 3.0, 1.0]]))
    # token 1 (prompt): 4 / 2, -1 * 2; token 3 (output): -4 * 2 - 0.5, 3 / 2 - 0.5; tokens 0, 2, 4 unseen
    assert out.tolist() == [[4.0, 2.0, 4.0, -8.5, -4.0], [0.0, -2.0, 0.0, 1.0, 1.0]]
    off = Adjuster(LogitAdjust(repetition_penalty=1.0), prompt_ids=[1])
    assert not off.spec.active and off.adjust(torch.ones(1, 3)).tolist() == [[1.0] * 3]
    assert validate(None, 0.0, 0.0, 10.0) is None
    for bad in (0.0, -1.0, 10.5, float("nan")):
        assert "repetition_penalty must be in (0, 10] (1 = off)" in validate(None, 0.0, 0.0, bad)


def test_withdrawn_tokens_stop_counting():
    """An edit or a remask takes a token out of the text (decoding.edits): `withdraw` uncounts it, before the first
    step (held with the commits) as after, so presence, frequency and repetition see only what the text holds."""
    a = Adjuster(LogitAdjust(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0))
    a.commit(torch.tensor([2, 2, 3]))
    a.withdraw(torch.tensor([2, 3]))            # an edit replaced one 2 and the 3 before V was known
    a.commit(torch.tensor([4]))                 # ... by a 4
    # token 2: count 1 -> 2 / 2 - 0.25 - 0.5; token 3: nothing; token 4: 2 / 2 - 0.75
    assert a.adjust(torch.full((1, 5), 2.0)).tolist() == [[2.0, 2.0, 0.25, 2.0, 0.25]]
    a.withdraw(torch.tensor([2, 4]))            # remasked: no output token left
    assert a.adjust(torch.full((1, 5), 2.0)).tolist() == [[2.0] * 5]


def test_params_reject_out_of_range_with_the_param_named():
    for kw, param in ((dict(frequency_penalty=-3.0), "frequency_penalty"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
                      (dict(logit_bias={1: 200.0}), "logit_bias"), (dict(repetition_penalty=0.0), "repetition_penalty")):
        with pytest.raises(InvalidRequestError) as e:
            GenerationParams(**kw)
        assert e.value.param == param


@pytest.fixture(scope="module")
def llms(family_dirs):
    return {name: LLM(family_dirs[name]) for name in ("sdar", "dream")}


@pytest.mark.parametrize("family", ["sdar", "dream"])
def test_logit_bias_forces_and_bans_tokens(llms, family):
    llm = llms[family]
    prompt = list(range(5, 15))
    base = GenerationParams(max_tokens=8, ignore_eos=True, block_size=4)
    plain = llm.generate(prompt, base)[0].token_ids
    forced = llm.generate(prompt, GenerationParams(max_tokens=8, ignore_eos=True, block_size=4,
                                                   logit_bias={42: 100.0}))[0].token_ids
    assert forced == [42] * 8
    banned = GenerationParams(max_tokens=8, ignore_eos=True, block_size=4, logit_bias={t: -100.0 for t in set(plain)})
    out = llm.generate(prompt, banned)[0].token_ids
    assert len(out) == 8 and not set(out) & set(plain)
    with pytest.raises(InvalidRequestError, match="outside this model's vocabulary"):
        llm.generate(prompt, GenerationParams(max_tokens=4, logit_bias={10**6: 1.0}))


def _run_with_adjust_spy(llm, monkeypatch, prompt, params, check) -> list[int]:
    """Step one request; call check(logits before, after adjustment, the adjuster's counts then, output
    committed before the step) for every adjusted step. Returns the output."""
    from unmask.decoding import logit_adjust

    seen = []
    original = logit_adjust.Adjuster.adjust

    def spy(self, logits):
        before = logits.clone()
        after = original(self, logits).clone()
        seen.append((before, after, self.counts.clone()))
        return logits

    monkeypatch.setattr(logit_adjust.Adjuster, "adjust", spy)
    seq = llm.engine.add_request(prompt, params)
    committed = []
    while not seq.finish_reason:
        n = len(seen)
        llm.engine.step()
        for before, after, counts in seen[n:]:
            check(before, after, counts, committed)
        out = seq.seq[seq.P:seq.end]
        committed = out[out != llm.spec.mask_id].tolist()
    assert len(seen) == params.max_tokens  # one token per forward: one adjusted step per token
    return committed


def test_penalties_see_exactly_the_committed_output(llms, monkeypatch):
    """Each step's logits lose frequency * count + presence * [count > 0] of the output committed before it."""
    def check(before, after, counts, committed):
        expected = torch.bincount(torch.tensor(committed, dtype=torch.long), minlength=before.shape[1]).float()
        assert torch.equal(counts, expected)
        assert torch.allclose(after, before - 0.75 * expected - 1.5 * (expected > 0).float())

    params = GenerationParams(max_tokens=12, ignore_eos=True, block_size=4, policy="topk", tokens_per_step=1,
                              presence_penalty=1.5, frequency_penalty=0.75)
    assert len(_run_with_adjust_spy(llms["sdar"], monkeypatch, list(range(5, 15)), params, check)) == 12


def test_repetition_penalty_sees_the_prompt_and_the_committed_output(llms, monkeypatch):
    prompt = list(range(5, 15))

    def check(before, after, counts, committed):
        hit = torch.zeros(before.shape[1], dtype=torch.bool)
        hit[prompt + committed] = True
        expected = torch.where(before > 0, before / 1.5, before * 1.5)
        assert torch.allclose(after[:, hit], expected[:, hit]) and torch.equal(after[:, ~hit], before[:, ~hit])

    params = GenerationParams(max_tokens=8, ignore_eos=True, block_size=4, policy="topk", tokens_per_step=1,
                              repetition_penalty=1.5)
    assert len(_run_with_adjust_spy(llms["sdar"], monkeypatch, prompt, params, check)) == 8


def test_server_defaults_take_the_models_penalties():
    from unmask.server.serving import sampling_defaults

    assert sampling_defaults({"frequency_penalty": 0.5}) == {"frequency_penalty": 0.5}
    assert sampling_defaults({"do_sample": True, "temperature": 0.7, "presence_penalty": 1}) == {
        "temperature": 0.7, "presence_penalty": 1}
    assert sampling_defaults({"temperature": 0.7}) == {}  # greedy unless the model samples
    assert sampling_defaults({"repetition_penalty": 1.1}) == {"repetition_penalty": 1.1}  # the transformers key
    # chat_defaults override the model-wide penalties for chat only; junk in it is ignored
    gen = {"frequency_penalty": 0.1, "presence_penalty": 0.2,
           "chat_defaults": {"frequency_penalty": 0.3, "temperature": 0.9, "repetition_penalty": "high"}}
    assert sampling_defaults(gen) == {"frequency_penalty": 0.1, "presence_penalty": 0.2}
    assert sampling_defaults(gen, chat=True) == {"frequency_penalty": 0.3, "presence_penalty": 0.2}
    assert sampling_defaults({"chat_defaults": [1]}, chat=True) == {}


def test_ban_early_stops_only_below_min_tokens_and_only_stop_tokens():
    logits = torch.zeros(4, 6)
    ban_early_stops(logits, torch.tensor([1, 2, 3, 4]), min_tokens=3, stops={2, 5, 99})  # 99: outside the vocab
    inf = float("-inf")
    assert logits.tolist() == [[0, 0, inf, 0, 0, inf], [0, 0, inf, 0, 0, inf], [0] * 6, [0] * 6]
    untouched = torch.zeros(2, 6)
    ban_early_stops(untouched, torch.tensor([0, 1]), min_tokens=0, stops={2})
    ban_early_stops(untouched, torch.tensor([0, 1]), min_tokens=5, stops=set())
    assert untouched.eq(0).all()
