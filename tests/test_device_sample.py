"""decoding/device_sample.py, the static step's sampling on the device: its counter-based uniforms, its sort-free
top-k / top-p against the sort-based rule (the same surviving tokens, ties and extreme values included), its draws
against the host's `propose` (the same token where the rule leaves one choice, the same distribution by counts
where it samples), and sampled requests in the engine's static step (tokens, reads, reproducibility)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sorted_sampling_reference import sorted_kept
from test_static_step import PROMPTS, checked_device_decisions, counted_steps, models  # noqa: F401 (fixture)
from unmask.decoding import device_sample
from unmask.decoding.device_sample import filtered, sample_rows, splitmix64, uniforms
from unmask.decoding.sampling import SamplingParams, propose
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.engine.static_step import sample_on_device_requested
from unmask.errors import InvalidRequestError


def splitmix64_reference(x: int) -> int:
    """SplitMix64's output function in Python integers (Steele et al.), the definition the tensor form follows."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_splitmix64_wraps_like_the_64_bit_definition():
    xs = [0, 1, 2, 12345, (1 << 62) + 7, (1 << 63) - 1, -1, -(1 << 63), -987654321]
    got = splitmix64(torch.tensor(xs, dtype=torch.long)).tolist()
    assert [g % (1 << 64) for g in got] == [splitmix64_reference(x % (1 << 64)) for x in xs]


def test_uniforms_are_per_seed_counter_and_column():
    seed = torch.tensor([7, 7, 8])
    u = uniforms(seed, torch.tensor([0, 1, 0]), 4)
    assert u.shape == (3, 4) and u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniforms(seed, torch.tensor([0, 1, 0]), 4))  # no state: the same inputs, the same draws
    assert len(set(u.flatten().tolist())) == 12
    many = uniforms(torch.full((20000,), 3), torch.arange(20000), 1).flatten()
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float((many < 0.1).float().mean()) - 0.1) < 0.01


def processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution `propose` draws from, as its docstring defines it: logits / T, the top_k largest, the
    smallest prefix of the sorted survivors with mass >= top_p, renormalised."""
    x = logits / temperature
    order = x.argsort(descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[order[:top_k or len(x)]] = True
    p = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=0)
    if top_p < 1:
        mass_before = p[order].cumsum(0) - p[order]
        drop = mass_before >= top_p
        drop[0] = False
        keep[order[drop]] = False
    return torch.softmax(x.masked_fill(~keep, float("-inf")), dim=0)


CONFIGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8), (0.9, 4, 0.7)]


@pytest.mark.parametrize("temperature, top_k, top_p", CONFIGS)
def test_device_draws_follow_the_hosts_distribution(temperature, top_k, top_p):
    """6,000 draws from one row each way: the device's counts and the host's (torch.multinomial) both within 5
    standard errors of the processed distribution, nothing drawn outside its support, and the device's p(x0) and
    log p(x0) those of the token it drew."""
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, -0.5, -1.0, 0.9, -3.0])
    v, n = logits.numel(), 6000
    rows = logits.expand(n, v).contiguous()
    s = sample_rows(rows, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
                    uniforms(torch.full((n,), 11), torch.arange(n), 1).flatten())
    host = propose(rows.clone(), SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                   torch.Generator().manual_seed(0))
    p = processed(logits, temperature, top_k, top_p)
    assert torch.allclose(host.probs, p[host.tokens], atol=1e-6)  # the reference is the host's distribution
    support = p > 0
    for tokens in (s.tokens, host.tokens):
        counts = torch.bincount(tokens, minlength=v).float()
        assert not counts[~support].any()
        se = (p * (1 - p) / n).sqrt()
        assert bool(((counts / n - p).abs() <= 5 * se + 1e-9).all()), (counts / n, p)
    assert torch.allclose(s.probs, p[s.tokens], atol=1e-6)
    assert torch.allclose(s.logprobs, p[s.tokens].log(), atol=1e-5)
    top2 = p.sort(descending=True).values
    assert torch.allclose(s.margin, (top2[0] - top2[1]).expand(n), atol=1e-6)


def test_a_single_choice_is_the_hosts_token():
    """top_k 1, or a top_p below the top token's mass: one token survives, the host's and the device's."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 300, generator=g) * 3
    u = uniforms(torch.full((50,), 2), torch.arange(50), 1).flatten()
    for top_k, top_p in ((1, 1.0), (0, 1e-4)):
        s = sample_rows(logits, torch.full((50,), 0.8), torch.full((50,), top_k), torch.full((50,), top_p), u)
        host = propose(logits.clone(), SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p),
                       torch.Generator().manual_seed(0))
        assert torch.equal(s.tokens, host.tokens) and torch.equal(s.tokens, logits.argmax(dim=1))
        assert torch.allclose(s.probs, torch.ones(50)) and torch.allclose(s.logprobs, host.logprobs)


def hard_rows(g: torch.Generator, n: int, v: int):
    """Row batches that stress the thresholds: continuous values, small integers and quarter steps (ties at every
    boundary), signed zeros (equal, so tied), and magnitudes near 1e30 with -inf entries."""
    yield torch.randn(n, v, generator=g) * 3
    yield torch.randint(-3, 4, (n, v), generator=g).float()
    yield (torch.randn(n, v, generator=g) * 2).round() / 4
    yield torch.randint(-1, 2, (n, v), generator=g).float() * torch.randint(0, 2, (n, v), generator=g).float()
    huge = torch.randn(n, v, generator=g) * 1e30
    yield huge.masked_fill(torch.rand(n, v, generator=g) < 0.3, float("-inf"))


def sorted_mass_before(row: torch.Tensor, temperature: float, top_k: int, token: int) -> float:
    """The mass before `token` in the stable descending order of the top_k survivors, in float64."""
    w, ids = (row / temperature).sort(descending=True, stable=True)
    k = top_k or len(row)
    p = torch.softmax(w[:k].double(), dim=0)
    pos = int((ids == token).nonzero())
    return float(p.cumsum(0)[pos] - p[pos]) if pos < k else float("inf")


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 1e-6])
def test_sort_free_selection_keeps_the_sorted_rules_tokens(top_p):
    """64 rows of each of five kinds for each of top_k 0 / 1 / 5 / V, temperatures 0.1-2.1: the same survivors as
    the stable sort's rule, token for token. top-k compares integers, so it matches exactly; top-p sums float32
    masses in another order than the sort's cumulative sum, so a row may differ only where the float64 mass
    before the token lies within 1e-5 of top_p (a rounding either way: 3 of 40,960 rows in a wider trial), and
    rarely."""
    g = torch.Generator().manual_seed(5)
    n, v, rounding_rows = 64, 700, 0
    for logits in hard_rows(g, n, v):
        for top_k in (0, 1, 5, v):
            temp = torch.rand(n, generator=g) * 2 + 0.1
            args = (logits, temp, torch.full((n,), top_k), torch.full((n,), top_p))
            want, got = sorted_kept(*args), filtered(*args) > float("-inf")
            if top_k and top_p == 1:
                assert torch.equal(got.sum(dim=1), torch.minimum((logits > float("-inf")).sum(dim=1),
                                                                 torch.tensor(top_k)))
            for r in torch.nonzero((want != got).any(dim=1)).flatten().tolist():
                assert top_p < 1, (top_k, r)
                for token in torch.nonzero(want[r] != got[r]).flatten().tolist():
                    assert abs(sorted_mass_before(logits[r], float(temp[r]), top_k, token) - top_p) < 1e-5
                rounding_rows += 1
    assert rounding_rows <= 2


def test_ties_at_the_boundaries_go_by_index():
    """Equal values in the order of their index, as the stable sort has them: top_k 2 of [1, 2, 2, 2, 0] keeps
    columns 1 and 2; of four equal tokens top_p 0.5 keeps two (the third's mass before, 0.5, reaches it), 0.51
    three, 0 the first only; -0.0 and +0.0 are equal."""
    cases = [([1.0, 2.0, 2.0, 2.0, 0.0], 2, 1.0, [1, 2]), ([0.5] * 4, 0, 0.5, [0, 1]), ([0.5] * 4, 0, 0.51, [0, 1, 2]),
             ([0.5] * 4, 0, 0.0, [0]), ([-0.0, 0.0, -0.0, -1.0], 2, 1.0, [0, 1]), ([3.0, 1.0, 1.0, 1.0], 3, 1e-6, [0])]
    for row, top_k, top_p, kept in cases:
        args = (torch.tensor([row]), torch.ones(1), torch.tensor([top_k]), torch.tensor([top_p]))
        got = torch.nonzero(filtered(*args)[0] > float("-inf")).flatten().tolist()
        assert got == kept == torch.nonzero(sorted_kept(*args)[0]).flatten().tolist(), (row, top_k, top_p)


def test_the_draw_inverts_the_cdf_in_vocabulary_order():
    """probabilities 0.1, 0.4, 0.2, 0.3: the uniform picks the first token whose cumulative mass in vocabulary
    order reaches it (0.05 -> 0, 0.3 -> 1, 0.6 -> 2, 0.9 -> 3; sorted order would give 1 for 0.05)."""
    logits = torch.tensor([0.1, 0.4, 0.2, 0.3]).log().expand(4, 4).contiguous()
    s = sample_rows(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4),
                    torch.tensor([0.05, 0.3, 0.6, 0.9], dtype=torch.float64))
    assert s.tokens.tolist() == [0, 1, 2, 3]
    assert torch.allclose(s.probs, torch.tensor([0.1, 0.4, 0.2, 0.3]))
    assert torch.allclose(s.margin, torch.full((4,), 0.1))


def test_a_rows_draw_does_not_depend_on_its_slice_or_neighbours():
    """40 rows (three slices of SLICE_ROWS_CPU on the CPU) with their own temperature, top-k and top-p: each row
    draws what it draws alone."""
    g = torch.Generator().manual_seed(8)
    n = 40
    assert n > 2 * device_sample.SLICE_ROWS_CPU
    args = (torch.randn(n, 300, generator=g) * 3, torch.rand(n, generator=g) + 0.3,
            torch.randint(0, 20, (n,), generator=g), torch.rand(n, generator=g) * 0.5 + 0.5,
            torch.rand(n, generator=g).double())
    batched = sample_rows(*args)
    alone = [sample_rows(*(a[r:r + 1] for a in args)) for r in range(n)]
    assert sample_rows(*(a[:0] for a in args)).tokens.shape == (0,)  # no rows: one empty slice
    assert batched.tokens.tolist() == [int(s.tokens) for s in alone]
    for field in ("probs", "margin", "logprobs"):
        assert torch.allclose(getattr(batched, field), torch.cat([getattr(s, field) for s in alone]))


class RecordedOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_sampling_runs_the_same_ops_whatever_the_values_and_reads_nothing_back():
    """What CUDA graph capture needs: the op sequence does not depend on the values (two different batches, top-k
    and top-p on and off, run the same ops), no value comes back to the host (no .item(): _local_scalar_dense),
    and nothing is sorted."""
    g = torch.Generator().manual_seed(3)
    runs = []
    for top_k, top_p, scale in ((0, 1.0, 1.0), (7, 0.8, 30.0)):
        with RecordedOps() as ops:
            sample_rows(torch.randn(6, 500, generator=g) * scale, torch.rand(6, generator=g) + 0.5,
                        torch.full((6,), top_k), torch.full((6,), top_p), torch.rand(6, generator=g).double())
        runs.append(ops.names)
    assert runs[0] == runs[1]
    assert not [op for op in runs[0] if "_local_scalar_dense" in op or "sort" in op]


def run(model, spec, prompts, params, static=True, max_num_seqs=8):
    eng = Engine(model, spec, max_num_seqs=max_num_seqs, static_step=static, kv_pool_tokens=4096)
    seqs = [eng.add_request(p, params) for p in prompts]
    eng.run_to_completion()
    return [s.output_ids for s in seqs], eng


def test_device_sampling_is_chosen_by_option_environment_or_capture(monkeypatch):
    monkeypatch.delenv("UNMASK_DEVICE_SAMPLING", raising=False)
    assert sample_on_device_requested(None, graphs=True) and not sample_on_device_requested(None, graphs=False)
    assert sample_on_device_requested(True, graphs=False) and not sample_on_device_requested(False, graphs=True)
    monkeypatch.setenv("UNMASK_DEVICE_SAMPLING", "1")
    assert sample_on_device_requested(None, graphs=False)
    monkeypatch.setenv("UNMASK_DEVICE_SAMPLING", "0")
    assert not sample_on_device_requested(None, graphs=True)
    monkeypatch.setenv("UNMASK_DEVICE_SAMPLING", "maybe")
    with pytest.raises(InvalidRequestError, match="UNMASK_DEVICE_SAMPLING must be one of .*got 'maybe'"):
        sample_on_device_requested(None, graphs=True)


@pytest.mark.parametrize("family", ["sdar", "fast_dllm_v2", "unmask_shifted"])
def test_sampled_requests_with_one_choice_give_the_eager_tokens_in_one_read(family, models, monkeypatch):
    """temperature 0.8 with top_k 1: the rule leaves one token, so the device's draws are the host's; the step's
    one read carries them (no logits copied out) and the device decides every commit."""
    monkeypatch.setenv("UNMASK_DEVICE_SAMPLING", "1")
    model, spec = models[family]
    params = GenerationParams(max_tokens=12, policy="topk", tokens_per_step=2, block_size=4, temperature=0.8,
                              top_k=1, seed=4)
    eager, _ = run(model, spec, PROMPTS[:3], params, static=False)
    made = checked_device_decisions(monkeypatch)
    eng = Engine(model, spec, max_num_seqs=8, static_step=True, kv_pool_tokens=4096)
    seqs = [eng.add_request(p, params) for p in PROMPTS[:3]]
    reads = counted_steps(eng, monkeypatch)
    eng.run_to_completion()
    st = eng.runner.static
    assert [s.output_ids for s in seqs] == eager and st.sample and made[0] > 0 and made[1] == 0
    assert set(reads) == {1} and all(key[4] for key in st.shapes)  # every shape sampled, one read each step


def test_seeded_device_draws_repeat_and_do_not_depend_on_the_batch(models, monkeypatch):
    """A seeded sampled request draws the same tokens alone, in a batch of five and again; another seed, others."""
    monkeypatch.setenv("UNMASK_DEVICE_SAMPLING", "1")
    model, spec = models["unmask_shifted"]  # a 96-token vocabulary: the CPU sorts it fast

    def params(seed):
        return GenerationParams(max_tokens=8, policy="topk", tokens_per_step=2, block_size=4, temperature=1.2,
                                seed=seed, ignore_eos=True)

    batched, eng = run(model, spec, PROMPTS, params(9))
    assert eng.runner.static.steps == eng.stats.steps
    for p, out in zip(PROMPTS, batched):
        assert run(model, spec, [p], params(9))[0] == [out]
    assert run(model, spec, PROMPTS, params(9))[0] == batched
    assert run(model, spec, PROMPTS, params(10))[0] != batched


def test_mixed_batches_keep_greedy_rows_greedy(models, monkeypatch):
    """Greedy and sampled requests in one sampled shape: the greedy ones give the eager path's tokens."""
    monkeypatch.setenv("UNMASK_DEVICE_SAMPLING", "1")
    model, spec = models["unmask_shifted"]  # a 96-token vocabulary: the CPU sorts it fast
    greedy = GenerationParams(max_tokens=8, policy="threshold", threshold=0.5, block_size=4)
    sampled = GenerationParams(max_tokens=8, policy="threshold", threshold=0.5, block_size=4, temperature=0.8,
                               top_p=0.9, seed=3)
    eng = Engine(model, spec, max_num_seqs=8, static_step=True, kv_pool_tokens=4096)
    seqs = [eng.add_request(p, sampled if i % 2 else greedy) for i, p in enumerate(PROMPTS)]
    eng.run_to_completion()
    eager, _ = run(model, spec, PROMPTS[::2], greedy, static=False)
    assert [seqs[i].output_ids for i in range(0, 5, 2)] == eager
    assert all(len(s.output_ids) > 0 for s in seqs[1::2]) and eng.runner.static.host_reads == 1
    assert any(key[4] for key in eng.runner.static.shapes)  # the sampled shapes ran
