"""The verification rule of self-speculative decoding (unmask.decoding.speculative): greedy matching, and
speculative sampling whose output follows the verifier's distribution exactly."""
import pytest
import torch

from unmask.decoding.sampling import SamplingParams, propose
from unmask.decoding.speculative import processed_probs, verify


def one_hot_rows(ids: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_keeps_the_matching_prefix_and_adds_the_verifiers_token():
    v = verify(torch.tensor([5, 6, 7]), None, one_hot_rows([5, 6, 1, 4]), greedy=True, generator=None)
    assert v.accepted == 2
    assert v.tokens.tolist() == [5, 6, 1]


def test_greedy_all_kept_then_the_token_after_them():
    v = verify(torch.tensor([5, 6]), None, one_hot_rows([5, 6, 3]), greedy=True, generator=None)
    assert (v.accepted, v.tokens.tolist()) == (2, [5, 6, 3])


def test_greedy_first_draft_wrong_and_no_drafts():
    v = verify(torch.tensor([2, 6]), None, one_hot_rows([5, 6, 3]), greedy=True, generator=None)
    assert (v.accepted, v.tokens.tolist()) == (0, [5])  # a later match does not count after a miss
    v = verify(torch.empty(0, dtype=torch.long), None, one_hot_rows([4]), greedy=True, generator=None)
    assert (v.accepted, v.tokens.tolist()) == (0, [4])


def test_verify_needs_one_row_more_than_drafts():
    with pytest.raises(ValueError, match="needs 3 verifier rows for 2 drafts"):
        verify(torch.tensor([1, 2]), None, one_hot_rows([1, 2]), greedy=True, generator=None)


def test_speculative_sampling_output_follows_the_verifier():
    """The first output token, over many draws with drafts from q, is distributed as p (not as q)."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(4)
    kept = 0
    for _ in range(n):
        d = torch.multinomial(q[0], 1, generator=g)
        v = verify(d, q, p, greedy=False, generator=g)
        counts[int(v.tokens[0])] += 1
        kept += v.accepted
    assert torch.allclose(counts / n, p[0], atol=0.012)
    # acceptance probability is sum_x min(p, q) = 0.1 + 0.2 + 0.15 + 0.05
    assert abs(kept / n - 0.5) < 0.012


def test_equal_distributions_keep_every_draft():
    p = torch.tensor([[0.2, 0.8], [0.6, 0.4], [1.0, 0.0]])
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        d = torch.tensor([int(torch.multinomial(p[0], 1, generator=g)), int(torch.multinomial(p[1], 1, generator=g))])
        v = verify(d, p[:2], p, greedy=False, generator=g)
        assert v.accepted == 2 and v.tokens.tolist() == [*d.tolist(), 0]


def test_processed_probs_is_the_distribution_propose_draws_from():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    sp = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    probs = processed_probs(logits, sp)
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    x = logits / 0.7
    top = torch.softmax(x[0, :3], -1)   # top_k = 3 keeps ids 0-2; top_p 0.9 then drops id 2 if the mass before it
    keep = (top.cumsum(0) - top) < 0.9  # reaches 0.9
    want = torch.zeros(5)
    want[:3] = torch.where(keep, top, torch.zeros(3))
    want /= want.sum()
    assert torch.allclose(probs[0], want, atol=1e-6)
    g = torch.Generator().manual_seed(3)
    drawn = torch.stack([propose(logits, sp, g).tokens for _ in range(400)]).flatten()
    assert set(drawn.tolist()) <= set(torch.nonzero(probs[0] > 0).flatten().tolist())
    assert processed_probs(logits, SamplingParams()).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
