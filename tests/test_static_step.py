"""The static-buffer step of the block-causal families (engine/static_step.py) and the KV pool it decodes over
(engine/kv_pool.py): the same tokens as the eager path for every family, batched at different lengths, across
row buckets and widths, padding included; one host read per greedy step; pool admission and refusal."""
import pytest
import torch

from naive_decode import naive_generate
from test_engine import make_unmask_shifted
from unmask.engine.engine import Engine
from unmask.engine.kv_pool import PAGE, KVPool, PooledCache
from unmask.engine.params import GenerationParams
from unmask.engine.static_step import ROW_BUCKETS, HostReads, StaticBatch, cuda_graphs_on, static_step_requested
from unmask.errors import MemoryLimitError
from unmask.models.loader import load_model

FAMILIES = ["sdar", "fast_dllm_v2", "llada2", "unmask_shifted", "unmask_causal_context"]
# 13, 5, 8, 3, 11 tokens: mid-block, short, aligned, shorter than a block, mid-block
PROMPTS = [list(range(20, 33)), list(range(40, 45)), list(range(50, 58)), [7, 9, 11], list(range(60, 71))]


@pytest.fixture(scope="module")
def models(family_dirs, tmp_path_factory):
    dirs = {**family_dirs, "unmask_shifted": make_unmask_shifted(tmp_path_factory.mktemp("unmask") / "m"),
            "unmask_causal_context": make_unmask_shifted(tmp_path_factory.mktemp("unmask") / "c", causal_context=True)}
    return {f: load_model(dirs[f]) for f in FAMILIES}


def checked_device_decisions(monkeypatch) -> list[int]:
    """Wraps the engine's `decide`: every commit mask the device made must be what the request's rule in
    decoding/policies.py gives for the same proposal (plus a forced first row, which `_choose` adds on the host);
    returns [decisions made on the device, decisions made on the host, device decisions with a forced first row]."""
    from unmask.decoding.device_select import DeviceDecision
    from unmask.decoding.policies import POLICIES
    from unmask.decoding.sampling import Proposal
    from unmask.engine import sequence

    made = [0, 0, 0]
    real = sequence.decide

    def decide(cfg, logits, positions, state, sampling, generator=None):
        if isinstance(logits, DeviceDecision):
            made[0] += 1
            host = POLICIES[cfg.name](cfg, Proposal(logits.tokens, logits.probs, logits.entropy, logits.margin,
                                                    logits.logprobs), state, generator)
            extra = logits.commit & ~host
            assert not (host & ~logits.commit).any() and not extra[1:].any(), (cfg.name, host, logits.commit)
            made[2] += bool(extra[0])
        else:
            made[1] += 1
        return real(cfg, logits, positions, state, sampling, generator)

    monkeypatch.setattr(sequence, "decide", decide)
    return made


def run(model, spec, prompts, params, static, **kw):
    eng = Engine(model, spec, max_num_seqs=16, static_step=static, kv_pool_tokens=kw.pop("pool", 4096), **kw)
    seqs = [eng.add_request(p, params) for p in prompts]
    eng.run_to_completion()
    return [s.output_ids for s in seqs], eng


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("knobs", [dict(policy="threshold", threshold=0.3), dict(policy="topk", tokens_per_step=2)])
def test_static_step_gives_the_eager_tokens(family, knobs, models, monkeypatch):
    """Five requests of different lengths (rows padded to a bucket of 8, then fewer as they finish), blocks of
    4 (a row's width 4 inside a block, 8 at a block's first step, which carries the finished block; first steps
    carry the prompt): token for token the eager path's, every decision of the static run made on the device
    and equal to the host rule's."""
    model, spec = models[family]
    params = GenerationParams(max_tokens=14, block_size=4, **knobs)
    eager, _ = run(model, spec, PROMPTS, params, static=False)
    made = checked_device_decisions(monkeypatch)
    static, eng = run(model, spec, PROMPTS, params, static=True)
    assert static == eager
    assert made[0] > 0 and made[1] == 0
    st = eng.runner.static
    assert st.steps == eng.stats.steps  # every step of these short prompts fits the buffers
    assert 8 in {k[0] for k in st.shapes} and len(st.shapes) >= 2, st.shapes.keys()  # buckets and widths change
    assert any(k[3] < k[1] for k in st.shapes)  # the output head reads fewer rows than were fed (K < W)
    assert eng.kv_pool.free_tokens == eng.kv_pool.capacity_tokens  # every run given back


def test_the_device_forces_a_blocks_first_token_where_the_family_does(models, monkeypatch):
    """Fast-dLLM v2 writes each block's first token greedily (ar_first_token): with one token per forward the
    device's commit adds that row beside the rule's choice, as `Sequence._choose` does on the host."""
    model, spec = models["fast_dllm_v2"]
    params = GenerationParams(max_tokens=12, block_size=4, policy="topk", tokens_per_step=1, ignore_eos=True)
    prompts = [[5 + i, 9, 17 + i] for i in range(3)]
    eager, _ = run(model, spec, prompts, params, static=False)
    made = checked_device_decisions(monkeypatch)
    static, _ = run(model, spec, prompts, params, static=True)
    assert static == eager and made[2] > 0


@pytest.mark.parametrize("family", ["sdar", "unmask_causal_context"])
def test_static_step_matches_the_naive_loop_alone_and_batched(family, models):
    model, spec = models[family]
    params = GenerationParams(max_tokens=13, policy="threshold", threshold=0.3, block_size=4)
    batched, _ = run(model, spec, PROMPTS[:3], params, static=True)
    for p, out in zip(PROMPTS[:3], batched):
        alone, _ = run(model, spec, [p], params, static=True)
        assert out == alone[0] == naive_generate(model, spec, p, params)


@pytest.mark.parametrize("family, knobs", [
    ("unmask_causal_context", dict(multi_block_threshold=0.5, threshold=0.6)),  # two open blocks in one row
    ("fast_dllm_v2", dict(small_block_size=2)),                                # sub-blocks
    ("sdar", dict(full_last_block=True, ordered_stops=True)),
    ("sdar", dict(logprobs=True)),                                              # logprobs from device proposals
    ("sdar", dict(logprobs=True, top_logprobs=3)),                              # top alternatives: logits path
    ("llada2", dict(edit_threshold=0.2)),                                       # edits: logits path
    ("sdar", dict(presence_penalty=0.5, min_tokens=6)),                         # adjusted logits: logits path
])
def test_request_options_give_the_eager_tokens_and_logprobs(family, knobs, models):
    model, spec = models[family]
    params = GenerationParams(max_tokens=13, block_size=4, **{"policy": "threshold", "threshold": 0.4, **knobs})
    got = []
    for static in (False, True):
        eng = Engine(model, spec, max_num_seqs=8, static_step=static, kv_pool_tokens=4096)
        seqs = [eng.add_request(p, params) for p in PROMPTS[:3]]
        eng.run_to_completion()
        got.append(seqs)
        if static:
            assert eng.runner.static.steps > 0
    for eager, static in zip(*got):
        assert static.output_ids == eager.output_ids
        if eager.logprobs is not None:  # equal up to float rounding (the step's matmuls see more rows)
            assert static.logprobs.tolist() == pytest.approx(eager.logprobs.tolist(), abs=1e-5)
        if eager.top is not None:
            assert static.top.ids.tolist() == eager.top.ids.tolist()


def checkerboard(pool: KVPool, pages: int) -> None:
    """Every other one of the first `pages` pages held by another owner: what requests get next is scattered."""
    for i in range(pages):
        pool.allocate(f"hold{i}", PAGE)
    for i in range(0, pages, 2):
        pool.release(f"hold{i}")


@pytest.mark.parametrize("scattered", [False, True])
def test_the_prefix_cache_fills_pooled_caches(models, scattered):
    """A second request with the same prompt loads its prompt blocks from the prefix cache into its pages (in a
    run, or scattered: the prefix cache's [:, lo:hi] slices go through the page table)."""
    model, spec = models["sdar"]
    params = GenerationParams(max_tokens=8, policy="threshold", threshold=0.5, block_size=4)
    prompt = list(range(30, 51))
    eng = Engine(model, spec, max_num_seqs=4, static_step=True, kv_pool_tokens=1024)
    if scattered:
        checkerboard(eng.kv_pool, 64)
    first = eng.add_request(prompt, params)
    eng.run_to_completion()
    second = eng.add_request(prompt, params)
    eng.step()
    assert second.stats.prefill_tokens < len(prompt) - 4  # most of the prompt came from the prefix cache
    eng.run_to_completion()
    assert second.output_ids == first.output_ids == naive_generate(model, spec, prompt, params)


def test_the_batch_shrinks_across_every_row_bucket(models):
    """Nine requests with 4 to 36 new tokens: as they finish the step goes from 16 rows (7 of them padding) down
    through 8, 4 and 2 to 1, each bucket with its own buffers; every request's tokens are the eager path's."""
    model, spec = models["unmask_shifted"]
    prompts = [[20 + i, 31, 40 + 2 * i] + list(range(50, 50 + i)) for i in range(9)]
    outs = []
    for static in (False, True):
        eng = Engine(model, spec, max_num_seqs=16, static_step=static, kv_pool_tokens=4096)
        seqs = [eng.add_request(p, GenerationParams(max_tokens=4 + 4 * i, policy="topk", tokens_per_step=2,
                                                    block_size=4, ignore_eos=True)) for i, p in enumerate(prompts)]
        eng.run_to_completion()
        outs.append([s.output_ids for s in seqs])
    assert outs[1] == outs[0] and [len(o) for o in outs[1]] == [4 + 4 * i for i in range(9)]
    assert {k[0] for k in eng.runner.static.shapes} == {16, 8, 4, 2, 1}


def test_sampled_requests_read_their_logits_and_match_eager(models):
    """Requests that sample (or adjust logits) get their rows' logits from the step's hidden states, mixed in one
    batch with greedy requests that get device-side proposals."""
    model, spec = models["sdar"]
    sampled = GenerationParams(max_tokens=12, policy="threshold", threshold=0.5, temperature=0.8, seed=3, block_size=4)
    greedy = GenerationParams(max_tokens=12, policy="threshold", threshold=0.5, block_size=4)
    outs = []
    for static in (False, True):
        eng = Engine(model, spec, max_num_seqs=8, static_step=static, kv_pool_tokens=4096)
        seqs = [eng.add_request(p, sampled if i % 2 else greedy) for i, p in enumerate(PROMPTS)]
        eng.run_to_completion()
        outs.append([s.output_ids for s in seqs])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("scattered", [False, True])
def test_long_prefill_chunks_run_eagerly_then_decode_statically(models, scattered):
    """The eager prefill chunk writes and reads the request's pages through PooledCache.write / read (scattered:
    every other page), the static steps after it read what it wrote."""
    model, spec = models["sdar"]
    prompt = [30 + (7 * i) % 50 for i in range(150)]
    params = GenerationParams(max_tokens=8, policy="threshold", threshold=0.5, block_size=4)
    eager, _ = run(model, spec, [prompt], params, static=False, max_batch_tokens=128)
    eng = Engine(model, spec, max_num_seqs=16, static_step=True, kv_pool_tokens=4096, max_batch_tokens=128)
    if scattered:
        checkerboard(eng.kv_pool, 64)
    seq = eng.add_request(prompt, params)
    eng.step()
    pages = eng.kv_pool.owned[seq.request_id].pages
    assert (pages[:3] == [0, 2, 4]) if scattered else (pages == list(range(len(pages))))
    eng.run_to_completion()
    static = [seq.output_ids]
    assert static == eager == [naive_generate(model, spec, prompt, params)]
    assert 0 < eng.runner.static.steps < eng.stats.steps  # the 128-token prefill chunk was eager
    assert {k[2] for k in eng.runner.static.shapes} == {256}  # context bucket past the 150-token prompt


def counted_steps(eng, monkeypatch):
    counts = []
    real = eng.runner.execute

    def execute(plans):
        with HostReads() as h:
            out = real(plans)
        counts.append(h.count)
        return out

    monkeypatch.setattr(eng.runner, "execute", execute)
    return counts


@pytest.mark.parametrize("family", ["sdar", "fast_dllm_v2", "unmask_shifted"])
def test_a_greedy_static_step_reads_the_device_once(family, models, monkeypatch):
    """The forward, the output head, the mask ban, the proposal and the threshold rule's commit stay on the
    device: the step's one host read is the [5, rows x K] copy of proposals and commit flags, and the host runs
    no rule. The eager path reads once per segment mask and once for the logits."""
    model, spec = models[family]
    params = GenerationParams(max_tokens=12, policy="threshold", threshold=0.5, block_size=4)
    counts = {}
    made = checked_device_decisions(monkeypatch)
    for static in (True, False):
        eng = Engine(model, spec, max_num_seqs=8, static_step=static, kv_pool_tokens=4096)
        for p in PROMPTS[:3]:
            eng.add_request(p, params)
        counts[static] = counted_steps(eng, monkeypatch)
        eng.run_to_completion()
        if static:
            assert eng.runner.static.host_reads == 1
            assert made[0] > 0 and made[1] == 0
    assert counts[True] and set(counts[True]) == {1}
    assert min(counts[False]) > 1


def test_llada2_moe_runs_sync_free_in_static_steps(models, monkeypatch):
    """The MoE's eager loop reads the chosen experts back (`.unique().tolist()`, a nonzero per expert); in a
    static step it runs grouped GEMMs over rows sorted by expert instead, so the step still reads once."""
    model, spec = models["llada2"]
    assert sum(hasattr(layer.mlp, "experts") for layer in model.model.layers) == 2
    eng = Engine(model, spec, max_num_seqs=8, static_step=True, kv_pool_tokens=4096)
    eng.add_request(PROMPTS[0], GenerationParams(max_tokens=8, policy="threshold", threshold=0.5, block_size=4))
    counts = counted_steps(eng, monkeypatch)
    eng.run_to_completion()
    assert counts and set(counts) == {1}


def test_padding_rows_and_tokens_are_invisible_to_real_rows():
    """The mask of one row fed 3 real tokens at cache position 5 in a width of 4, beside a padding row."""
    pool = KVPool([(1, 2)], 64, torch.float32, "cpu", scratch=16)
    big = 1 << 40
    ids = torch.zeros(2, 4, dtype=torch.long)
    bids = torch.tensor([[1, 1, 2, big], [big] * 4])
    table = torch.tensor([[2], pool.scratch_pages])  # the real row's positions live in page 2
    batch = StaticBatch(pool, ids, bids, torch.tensor([5, 0]), table, context=16)
    batch.prepare()
    assert batch.write_idx.tolist() == [[37, 38, 39, 40], [64, 65, 66, 67]]  # page 2 from position 5; scratch
    assert batch.read_idx[0].tolist() == list(range(32, 48))
    m = batch.mask[:, 0]
    assert m.shape == (2, 4, 16)  # [rows, W, context]: no T x T mask over the sequence
    real = m[0, :3]
    assert real[:, :5].all()                      # the cached prefix, whole
    assert real[:2, 5:7].all() and not real[:2, 7].any()  # block 1 sees itself, not block 2
    assert real[2, 5:8].all()                     # block 2 sees blocks 1 and 2
    assert not real[:, 8:].any()                  # never the padding token at 8, nor anything after
    assert m[1].any(dim=1).all()                  # every padding query sees something: no NaN rows


def test_kv_pool_hands_out_pages_wherever_they_are_free():
    """Lowest pages first; freed pages are reused wherever they are, so a fragmented pool still admits a request
    that fits its free pages in all (contiguous runs would not: here the largest free run is 3 pages)."""
    pool = KVPool([(2, 4)] * 3, 10 * PAGE, torch.float32, "cpu", scratch=PAGE)
    a = pool.allocate("a", 3 * PAGE)
    b = pool.allocate("b", 2 * PAGE + 1)   # rounds up to 3 pages
    c = pool.allocate("c", 4 * PAGE)
    assert (a.pages, b.pages, c.pages) == ([0, 1, 2], [3, 4, 5], [6, 7, 8, 9]) and b.capacity == 3 * PAGE
    assert pool.allocate("d", PAGE) is None  # full
    pool.release("b")
    e = pool.allocate("e", PAGE)
    pool.release("a")
    assert e.pages == [3] and pool.free_tokens == 5 * PAGE
    d = pool.allocate("d", 5 * PAGE)
    assert d.pages == [0, 1, 2, 4, 5] and d.slots[3 * PAGE:3 * PAGE + 2].tolist() == [4 * PAGE, 4 * PAGE + 1]
    # writes and reads go through the page table, also across a page boundary
    k = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4)
    d.write(1, 3 * PAGE - 2, k, -k)
    assert torch.equal(pool.k[1][:, 3 * PAGE - 2:3 * PAGE], k[:, :2]) and torch.equal(pool.k[1][:, 4 * PAGE:4 * PAGE + 3], k[:, 2:])
    got_k, got_v = d.read(1, 3 * PAGE + 3, torch.float32)
    assert torch.equal(got_k[:, -5:], k) and torch.equal(got_v[:, -5:], -k)
    # the prefix cache slices caches by position: [:, lo:hi] gathers and scatters the same way
    assert torch.equal(d.k[1][:, 3 * PAGE - 2:3 * PAGE + 3], k)
    d.v[2][:, PAGE:PAGE + 2] = torch.ones(2, 2, 4)
    assert bool((pool.v[2][:, PAGE:PAGE + 2] == 1).all())
    with pytest.raises(TypeError, match="sliced as"):
        d.k[0][0]
    with pytest.raises(RuntimeError, match="asked for"):
        d.reserve(d.capacity + 1)
    pool.release("c")
    pool.release("d")
    pool.release("e")
    assert pool.free_tokens == pool.capacity_tokens and sorted(pool.free_pages) == list(range(10))


def test_requests_in_scattered_pages_give_the_eager_tokens(models):
    """Pages held by other owners in a checkerboard: each request's pages are scattered, and one that needs more
    pages than any free run holds is still admitted; tokens are the eager path's, every page comes back."""
    model, spec = models["sdar"]
    params = GenerationParams(max_tokens=12, policy="threshold", threshold=0.4, block_size=4)
    eager, _ = run(model, spec, PROMPTS, params, static=False)
    eng = Engine(model, spec, max_num_seqs=8, static_step=True, kv_pool_tokens=64 * PAGE)
    pool = eng.kv_pool
    checkerboard(pool, 64)  # 32 free pages, none next to another
    seqs = [eng.add_request(p, params) for p in PROMPTS]
    eng.step()  # admission takes the pages
    caches = [pool.owned[s.request_id] for s in seqs]
    eng.run_to_completion()
    assert [s.output_ids for s in seqs] == eager
    assert all(len(c.pages) >= 5 and all(b - a == 2 for a, b in zip(c.pages, c.pages[1:])) for c in caches)
    assert eng.runner.static.steps == eng.stats.steps
    assert pool.free_tokens == 32 * PAGE


def test_a_full_pool_queues_requests_and_an_oversized_one_is_refused(models):
    model, spec = models["sdar"]
    params = GenerationParams(max_tokens=12, policy="threshold", threshold=0.5, block_size=4)
    # each request takes prompt + 12 rounded to blocks + 64 scratch = 80-96 tokens: two fit in 192 at once
    eng = Engine(model, spec, max_num_seqs=8, static_step=True, kv_pool_tokens=192)
    seqs = [eng.add_request(p, params) for p in PROMPTS]
    running = []
    while eng.has_unfinished():
        eng.step()
        running.append(eng.num_running)
    assert max(running) == 2
    eager, _ = run(model, spec, PROMPTS, params, static=False)
    assert [s.output_ids for s in seqs] == eager
    with pytest.raises(MemoryLimitError, match=r"preallocated KV pool, which holds 192 .*at most 128 tokens"):
        eng.add_request(list(range(20, 140)), params)


def test_the_static_step_is_selected_by_option_or_environment(monkeypatch, models):
    monkeypatch.delenv("UNMASK_STATIC_STEP", raising=False)
    monkeypatch.delenv("UNMASK_CUDA_GRAPHS", raising=False)
    assert not static_step_requested(None) and static_step_requested(True)
    monkeypatch.setenv("UNMASK_STATIC_STEP", "1")
    assert static_step_requested(None) and not static_step_requested(False)
    model, spec = models["sdar"]
    eng = Engine(model, spec, max_num_seqs=2, kv_pool_tokens=1024)
    assert eng.runner.static is not None and eng.kv_pool.capacity_tokens == 1024
    assert not eng.runner.static.graphs  # no capture off CUDA: the same forward runs on the buffers
    assert cuda_graphs_on(torch.device("cuda"))
    monkeypatch.setenv("UNMASK_CUDA_GRAPHS", "0")
    assert not cuda_graphs_on(torch.device("cuda")) and not cuda_graphs_on(torch.device("cpu"))
    assert ROW_BUCKETS[:4] == (1, 2, 4, 8)


def test_llm_takes_the_static_step_options(family_dirs):
    from unmask.engine.llm import LLM

    llm = LLM(family_dirs["sdar"], static_step=True, kv_pool_tokens=512, max_num_seqs=2)
    assert llm.engine.kv_pool.capacity_tokens == 512
    params = GenerationParams(max_tokens=6, policy="topk", tokens_per_step=2, block_size=4)
    out = llm.generate([[5, 9, 17], [6, 9, 18]], params)
    assert [len(o.token_ids) for o in out] == [6, 6] and llm.engine.runner.static.steps > 0


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: `replay` reruns the captured forward into the tensors the
    capture returned, which is what a replay does on a GPU."""

    def __init__(self):
        self.fn = None
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.fn()


class FakeCapture:
    def __init__(self, graph, pool=None):
        self.graph, self.pool = graph, pool

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("gpu_defaults", [False, True])
def test_the_capture_path_replays_into_the_captured_outputs(gpu_defaults, models, monkeypatch):
    """The CUDA-only branch on the CPU, with torch.cuda's graph API replaced by stand-ins: warm-up under the
    sync-refusing debug mode on a side stream, one capture per shape, replays after, same tokens as eager.
    gpu_defaults: as on a GPU, sampled requests draw inside the graph (one here, whose top_k 1 leaves the
    eager token) and up to 4 rows keep the wider width; the replays advance their own inputs."""
    from unmask.engine import static_step as S

    modes = []
    fake_stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "Stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: fake_stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: FakeCapture(None))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    real_capture = S.StaticStep._capture

    def capture(self, forward, *buffers):
        shape = real_capture(self, forward, *buffers)

        def rerun():
            hidden, packed = forward()
            shape.hidden.copy_(hidden)
            shape.packed.copy_(packed)

        shape.run.__self__.fn = rerun
        return shape

    monkeypatch.setattr(S.StaticStep, "_capture", capture)
    model, spec = models["sdar"]
    params = [GenerationParams(max_tokens=12, policy="threshold", threshold=0.4, block_size=4)] * 5
    if gpu_defaults:
        params = params[:3] + [GenerationParams(max_tokens=12, policy="threshold", threshold=0.4, block_size=4,
                                                temperature=0.8, top_k=1, seed=1)]
    eng = Engine(model, spec, max_num_seqs=8, static_step=True, kv_pool_tokens=4096)
    st = eng.runner.static
    st.graphs, st.mempool = True, torch.cuda.graph_pool_handle()
    if gpu_defaults:
        st.sample, st.sticky_rows = True, 4
    seqs = [eng.add_request(p, q) for p, q in zip(PROMPTS, params)]
    eng.run_to_completion()
    eager = []
    for p, q in zip(PROMPTS, params):
        eager += run(model, spec, [p], q, static=False)[0]
    assert [s.output_ids for s in seqs] == eager
    if gpu_defaults:
        assert any(key[4] for key in st.shapes) and st.resident.resident > 0
    assert st.captures == len(st.shapes) and all(shape.captured for shape in st.shapes.values())
    assert st.replays == st.steps > st.captures
    assert modes[:2] == ["error", 0]  # the warm-up refused synchronising ops, then the mode came back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [True, False])
def test_the_sync_free_moe_equals_the_expert_loop(dtype, grouped):
    """Grouped GEMMs (torch._grouped_mm over rows sorted by expert) give the loop's output exactly, the
    every-expert fallback up to rounding, neither reading anything back; the grouped form's stacked weights are
    the experts' own parameters, not a copy."""
    from unmask.models.layers import GroupLimitedMoE

    torch.manual_seed(0)
    moe = GroupLimitedMoE(32, 16, 8, 2, 4, 2, 1, 2.5, True).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.2)
        moe.gate.expert_bias.normal_(std=0.03)
    if not grouped:
        moe._stack = False
    x = torch.randn(3, 5, 32, dtype=dtype)
    with torch.no_grad(), HostReads() as reads:
        got = moe.forward_sync_free(x)
    assert reads.count == 0
    with torch.no_grad():
        want = moe(x)
    if grouped:  # the same per-group products, added in the same order
        assert torch.equal(got, want)
    else:  # each expert's matmul over all rows instead of its own: float rounding
        assert torch.allclose(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    if grouped:
        assert moe._stack and moe.experts[5].up_proj.weight.data_ptr() == moe._stack[1][5].data_ptr()
