"""Prompt-lookup drafts for the `speculative` policy (`draft_lookup`): the pure lookup rule, a copied draft's law
under speculative sampling, and in the engine the same output as next-token decoding in fewer forwards."""
import pytest
import torch

from unmask.decoding.speculative import lookup_drafts, verify
from unmask.engine.params import GenerationParams, model_policy
from unmask.errors import InvalidRequestError

from test_speculative import AR, MODEL, code_prompts, memoised, one_by_one  # noqa: F401  (the shared model and prompts)


def ids(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_lookup_copies_what_followed_the_latest_earlier_occurrence():
    # suffix "1 2 3" occurs at 1; what followed it there is 9 9 1 2 ...
    assert lookup_drafts(ids(5, 1, 2, 3, 9, 9, 1, 2, 3), 4).tolist() == [9, 9, 1, 2]
    # the latest earlier occurrence wins: "7" is followed by 1 at 0 and by 2 at 2
    assert lookup_drafts(ids(7, 1, 7, 2, 7), 1).tolist() == [2]
    # the longest suffix wins over a later shorter one: "4 5" at 0 (followed by 6), "5" alone later (by 8)
    assert lookup_drafts(ids(4, 5, 6, 5, 8, 4, 5), 1).tolist() == [6]


def test_lookup_continues_a_period_and_is_empty_without_a_match():
    assert lookup_drafts(ids(1, 2, 3, 4, 1, 2), 6).tolist() == [3, 4, 1, 2, 3, 4]
    assert lookup_drafts(ids(3, 3, 3), 4).tolist() == [3, 3, 3, 3]
    assert lookup_drafts(ids(7, 8, 9), 3).numel() == 0
    assert lookup_drafts(ids(4), 3).numel() == 0
    assert lookup_drafts(ids(1, 2, 1, 2), 0).numel() == 0
    # min_ngram 2: a one-token match is not enough
    assert lookup_drafts(ids(7, 1, 8, 7), 2, min_ngram=2).numel() == 0


def window_match_ends(ids, top, bottom):
    """The reference: every window of n tokens ending before the last token, compared with the last n."""
    n_ids = int(ids.numel())
    for n in range(top, bottom - 1, -1):
        windows = ids[:n_ids - 1].unfold(0, n, 1)
        yield n, (windows == ids[n_ids - n:]).all(1).nonzero().squeeze(1) + (n - 1)


def test_the_one_pass_search_finds_what_comparing_every_window_finds():
    """match_ends extends last-token matches instead of comparing every window: the same ends on random texts of
    few symbols (many matches, periods, no match), at every n range."""
    from unmask.decoding.speculative import match_ends

    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        x = torch.randint(0, int(torch.randint(2, 6, (1,), generator=g)), (int(torch.randint(2, 40, (1,), generator=g)),),
                          generator=g)
        for top, bottom in ((3, 1), (3, 2), (2, 2), (1, 1)):
            top = min(top, x.numel() - 1)
            want = [(n, e.tolist()) for n, e in window_match_ends(x, top, bottom)]
            assert want == [(n, e.tolist()) for n, e in match_ends(x.numpy(), top, bottom)]
    # and through lookup_drafts on a long text: "4 5 6" recurs at 5,000
    text = torch.arange(10, 8010) % 997 + 10
    text[5000:5003] = torch.tensor([4, 5, 6])
    text[-3:] = torch.tensor([4, 5, 6])
    assert lookup_drafts(text, 4).tolist() == text[5003:5007].tolist()


def test_a_copied_draft_keeps_the_verifiers_law_under_sampling():
    """A copied draft is certain (q one-hot): it is kept with probability p(d), else the token is drawn from p
    without d; the output follows p either way."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    g = torch.Generator().manual_seed(0)
    n, counts, kept = 20000, torch.zeros(4), 0
    q = torch.nn.functional.one_hot(torch.tensor([1]), 4).float()
    for _ in range(n):
        v = verify(torch.tensor([1]), q, p, greedy=False, generator=g)
        counts[int(v.tokens[0])] += 1
        kept += v.accepted
    assert torch.allclose(counts / n, p[0], atol=0.012)
    assert abs(kept / n - 0.3) < 0.012


@pytest.fixture(scope="module")
def llm():
    from unmask.engine.llm import LLM

    return LLM(MODEL, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts(llm):
    repetitive = "def fields(row):\n    a = row['a']\n    b = row['b']\n    c = row['c']\n"
    return [llm.encode(p) for p in [*code_prompts(), repetitive]]


@pytest.fixture(scope="module")
def reference(llm, prompts):
    return memoised(llm, prompts)


@pytest.mark.parametrize("knobs", [dict(), dict(block_size=4), dict(frequency_penalty=0.5),
                                   dict(draft_all_outcomes=True)])
def test_greedy_output_is_next_token_decoding_in_fewer_forwards_than_without(llm, prompts, reference, knobs):
    ref = reference(**AR, **{k: v for k, v in knobs.items() if k == "frequency_penalty"})
    plain = one_by_one(llm, prompts, policy="speculative", **knobs)
    got = one_by_one(llm, prompts, policy="speculative", draft_lookup=8, **knobs)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    if not knobs.get("draft_all_outcomes"):  # there the blocks differ by outcome: no order between the two
        assert sum(o.forwards for o in got) < sum(o.forwards for o in plain)


def test_a_copy_that_disagrees_with_the_diffusion_drafts_is_verified_beside_them(llm, prompts, reference):
    """Greedy, with diffusion drafts: a copy of the committed text that differs from them is a second chain in
    the same forward; the branch that keeps more wins, and the output is still next-token decoding."""
    from unmask.engine.engine import Engine

    eng = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=8, prefix_cache_bytes=0)
    for knobs, expect_wins in [(dict(block_size=4), True), (dict(block_size=4, draft_all_outcomes=True), True),
                               (dict(block_size=4, frequency_penalty=0.5), False),
                               (dict(block_size=4, temperature=0.7, seed=3), False)]:
        seqs = [eng.add_request(p, GenerationParams(max_tokens=40, policy="speculative", draft_lookup=8, **knobs))
                for p in prompts]
        eng.run_to_completion()
        wins = sum(s.copy_wins for s in seqs)
        assert (wins > 0) == expect_wins, (knobs, wins)  # adjusted or sampled rows keep the single chain
        if "temperature" not in knobs:
            ar = dict(AR, **{k: v for k, v in knobs.items() if k == "frequency_penalty"})
            ref = reference(**ar)
            assert [s.output_ids for s in seqs] == [o.token_ids for o in ref]


def test_all_outcomes_places_blocks_after_each_count_of_diffusion_drafts_and_after_all():
    from types import SimpleNamespace

    from unmask.engine.speculative import SpeculativeSequence

    def outcomes(all_outcomes, n_diffusion, k, from_table=False):
        seq = SimpleNamespace(all_outcomes=all_outcomes, drafts=torch.arange(n_diffusion), _from_table=from_table)
        return SpeculativeSequence._outcomes(seq, k)

    assert outcomes(True, 3, 11) == [0, 1, 2, 3, 11]   # 8 copied drafts after 3 diffusion ones: no block each
    assert outcomes(True, 3, 3) == [0, 1, 2, 3]
    assert outcomes(True, 3, 2) == [0, 1, 2]            # the end of the canvas cut the drafts
    assert outcomes(True, 0, 8) == [0, 8]               # a copy alone: a refused first draft still has a block
    assert outcomes(True, 0, 0) == [0]
    assert outcomes(False, 3, 11) == [11]
    assert outcomes(False, 0, 8) == [8]                 # a prompt-lookup copy alone: after all of it
    assert outcomes(False, 0, 8, from_table=True) == [0]   # the n-gram table's draft alone: after none of it
    assert outcomes(False, 3, 11, from_table=True) == [11]  # table drafts after diffusion ones: after all
    assert outcomes(True, 0, 8, from_table=True) == [0, 8]


def test_all_outcomes_with_lookup_needs_fewer_forwards(llm, prompts):
    """A refused diffusion draft leaves the next step drafts from its outcome's block, and the copy is still a
    second chain: fewer forwards than one block after all drafts, and the same output."""
    one = one_by_one(llm, prompts, policy="speculative", draft_lookup=8, block_size=4)
    every = one_by_one(llm, prompts, policy="speculative", draft_lookup=8, block_size=4, draft_all_outcomes=True)
    assert [o.token_ids for o in every] == [o.token_ids for o in one]
    assert sum(o.forwards for o in every) < sum(o.forwards for o in one)


def test_second_chain_layout():
    from unmask.engine.speculative import draft_layout, with_branch

    # T = 2 committed, D = 1 draft, one block of 2 (outcome 1); then a copy of 2 and its block of 2
    a = with_branch(draft_layout(2, 1, [2], [1]), n_committed=2, n_alt=2, block=2)
    T, F = True, False
    assert a.tolist() == [
        [T, F, F, F, F, F, F, F, F],   # T0
        [T, T, F, F, F, F, F, F, F],   # T1
        [T, T, T, F, F, F, F, F, F],   # d0
        [T, T, T, T, T, F, F, F, F],   # block after d0
        [T, T, T, T, T, F, F, F, F],
        [T, T, F, F, F, T, F, F, F],   # c0: T and itself
        [T, T, F, F, F, T, T, F, F],   # c1
        [T, T, F, F, F, T, T, T, T],   # block after the copy: T, the copy, itself
        [T, T, F, F, F, T, T, T, T],
    ]


def test_sampling_with_lookup_is_seeded(llm, prompts):
    knobs = dict(max_tokens=40, policy="speculative", draft_lookup=8, temperature=0.7, top_k=20, seed=5)
    a = llm.generate(prompts, [GenerationParams(**knobs) for _ in prompts])
    b = llm.generate(prompts, [GenerationParams(**knobs) for _ in prompts])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.forwards for o in a) < sum(len(o.token_ids) for o in a)


@pytest.mark.parametrize("bad", [-1, 65, 2.5, True, "4"])
def test_bad_values_are_refused_naming_the_field(bad):
    with pytest.raises(InvalidRequestError, match="draft_lookup must be an integer in \\[0, 64\\]") as e:
        GenerationParams(policy="speculative", draft_lookup=bad)
    assert e.value.param == "draft_lookup"


def test_a_model_may_name_it_in_its_default_policy():
    chosen = model_policy({"default_policy": {"policy": "speculative", "block_size": 4, "draft_lookup": 8}})
    assert chosen == {"policy": "speculative", "block_size": 4, "draft_lookup": 8}
    assert model_policy({"default_policy": {"policy": "speculative", "draft_lookup": "8"}}) == {"policy": "speculative"}
    resolved = GenerationParams().with_model_policy(chosen, allowed=True)
    assert (resolved.policy, resolved.block_size, resolved.draft_lookup) == ("speculative", 4, 8)
    mine = GenerationParams(draft_lookup=0).with_model_policy(chosen, allowed=True)
    assert mine.draft_lookup == 0
