"""DRY loop penalty: the arithmetic against a brute-force reference, the engine hook, the request fields."""
from __future__ import annotations

import random

import pytest
import torch

from unmask.decoding.dry import DryParams, breaker_mask, dry_penalty, validate
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams, sampling_defaults
from unmask.errors import InvalidRequestError


def reference_penalty(context: list[int], p: DryParams, breakers: set[int]) -> dict[int, float]:
    """The definition, quadratically: for every earlier end j of the context's last token, walk back while
    the tokens agree and are not breakers; the longest walk per following token sets its penalty."""
    if p.last_n > 0:
        context = context[-p.last_n:]
    best: dict[int, int] = {}
    L = len(context)
    for j in range(L - 1):
        n = 0
        while (n <= j and context[j - n] == context[L - 1 - n] and context[L - 1 - n] not in breakers
               and n < p.max_match):
            n += 1
        if n >= p.allowed_length:
            best[context[j + 1]] = max(best.get(context[j + 1], 0), n)
    return {t: p.multiplier * p.base ** (n - p.allowed_length) for t, n in best.items()}


def as_dict(ids, penalty) -> dict[int, float]:
    return dict(zip(ids.tolist(), penalty.tolist()))


def test_hand_worked_matches():
    p = DryParams(multiplier=0.8)
    # "5 6 7" occurred before, followed by 8: a match of 3 -> 0.8 * 1.75 ** (3 - 2)
    ids, pen = dry_penalty(torch.tensor([5, 6, 7, 8, 9, 5, 6, 7]), p)
    assert ids.tolist() == [8] and pen.tolist() == pytest.approx([1.4])
    # a loop: the longest earlier match of the tail "1 2" is "1 2 3 1 2" (5 tokens), followed by 3
    ids, pen = dry_penalty(torch.tensor([1, 2, 3, 1, 2, 3, 1, 2]), p)
    assert ids.tolist() == [3] and pen.tolist() == pytest.approx([0.8 * 1.75 ** 3])
    # a match shorter than allowed_length goes free
    assert dry_penalty(torch.tensor([4, 7, 5, 7]), p)[0].numel() == 0
    # a breaker ends the match: 6 is a breaker, so only "7" matches (1 < 2) and nothing is penalised
    brk = torch.zeros(10, dtype=torch.bool)
    brk[6] = True
    assert dry_penalty(torch.tensor([5, 6, 7, 8, 9, 5, 6, 7]), p, brk)[0].numel() == 0
    # the last token a breaker: nothing
    assert dry_penalty(torch.tensor([6, 6, 6, 6]), p, brk)[0].numel() == 0
    # last_n: the earlier "5 6 7" falls outside the window
    assert dry_penalty(torch.tensor([5, 6, 7, 8, 9, 5, 6, 7]), DryParams(multiplier=0.8, last_n=4))[0].numel() == 0


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_brute_force_definition(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 4, 6])
    context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    p = DryParams(multiplier=rng.choice([0.5, 0.8, 2.0]), base=rng.choice([1.0, 1.75, 3.0]),
                  allowed_length=rng.choice([1, 2, 3]), last_n=rng.choice([-1, 10, 30]))
    breakers = {t for t in range(vocab) if rng.random() < 0.2}
    mask = torch.tensor([t in breakers for t in range(vocab)])
    got = as_dict(*dry_penalty(torch.tensor(context), p, mask))
    want = reference_penalty(context, p, breakers)
    assert got.keys() == want.keys()
    for t in want:
        assert got[t] == pytest.approx(want[t], rel=1e-6)


def test_breaker_mask_and_validation():
    assert breaker_mask(["a", "b\n", "x:y", "\"", "ok"], ("\n", ":", "\"")).tolist() == [False, True, True, True, False]
    assert validate(DryParams(multiplier=0.8)) is None
    assert "dry_multiplier must be in [0, 10]" in validate(DryParams(multiplier=-1))
    assert "dry_base must be in [1, 10]" in validate(DryParams(multiplier=1, base=0.5))
    assert "dry_allowed_length must be an integer in [1, 64]" in validate(DryParams(allowed_length=0))
    assert "dry_penalty_last_n must be an integer >= -1" in validate(DryParams(last_n=-2))
    assert "dry_sequence_breakers must be" in validate(DryParams(breakers=("",)))
    assert not DryParams().active and not DryParams(multiplier=1, last_n=0).active
    for kw, param in ((dict(dry_multiplier=11.0), "dry_multiplier"), (dict(dry_base=0.0), "dry_base"),
                      (dict(dry_allowed_length=1.5), "dry_allowed_length"),
                      (dict(dry_sequence_breakers="\n"), "dry_sequence_breakers")):
        with pytest.raises(InvalidRequestError) as e:
            GenerationParams(**kw)
        assert e.value.param == param


def test_model_defaults_carry_dry_settings():
    gen = {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"], "chat_defaults": {"dry_multiplier": 0.0}}
    assert sampling_defaults(gen) == {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"]}
    assert sampling_defaults(gen, chat=True) == {"dry_multiplier": 0.0, "dry_sequence_breakers": ["\n"]}


@pytest.fixture(scope="module")
def sdar(family_dirs):
    return LLM(family_dirs["sdar"])


def repeated_pairs(context: list[int], start: int) -> int:
    """Output positions i >= start whose pair (context[i-1], context[i]) occurred earlier in the context."""
    return sum(any(context[j - 1:j + 1] == context[i - 1:i + 1] for j in range(1, i)) for i in range(start, len(context)))


def test_engine_applies_dry_to_the_first_open_position(sdar, monkeypatch):
    """Block size 1: every token is decided at the first open position, so a prohibitive DRY (every pair
    seen before costs 50) leaves no repeated pair in the output, where the plain greedy run repeats."""
    from unmask.engine import sequence

    prompt = [5, 6, 7, 5, 6, 7, 8]
    plain = sdar.generate(prompt, GenerationParams(max_tokens=24, ignore_eos=True, block_size=1))[0].token_ids
    assert repeated_pairs(prompt + plain, len(prompt)) > 0   # the random model loops
    contexts = []
    original = sequence.dry_penalty

    def spy(context, params, breakers=None):
        contexts.append(context.clone())
        return original(context, params, breakers)

    monkeypatch.setattr(sequence, "dry_penalty", spy)
    params = GenerationParams(max_tokens=24, ignore_eos=True, block_size=1, dry_multiplier=10.0, dry_base=5.0,
                              dry_allowed_length=1, dry_sequence_breakers=[])
    out = sdar.generate(prompt, params)[0].token_ids
    assert repeated_pairs(prompt + out, len(prompt)) == 0
    # each call saw exactly the prompt and the output committed before it
    assert [c.tolist() for c in contexts] == [prompt + out[:i] for i in range(len(out))]


def test_server_fields_reach_the_params():
    from unmask.engine.params import PENALTY_KEYS
    from unmask.server.protocol import DRY_FIELDS, CompletionRequest

    # the protocol module imports nothing of the engine, so it names the fields itself: they must agree
    assert ("presence_penalty", "frequency_penalty", "repetition_penalty", *DRY_FIELDS) == PENALTY_KEYS

    req = CompletionRequest(prompt="x", dry_multiplier=0.8, dry_allowed_length=3, dry_sequence_breakers=["\n"])
    kw = req.generation_kwargs()
    assert {k: kw[k] for k in kw if k.startswith("dry_")} == {
        "dry_multiplier": 0.8, "dry_allowed_length": 3, "dry_sequence_breakers": ["\n"]}
    assert GenerationParams(**kw).dry() == DryParams(0.8, 1.75, 3, -1, ("\n",))
