"""The compiled CPU step (engine/compiled_step.py): a step's forward over padded rows, compiled by inductor per
shape, gives the eager forward's logits (float32, tight) for every segment layout the engine feeds (the
self-speculative layout, block ids, several requests of different caches at once), the same greedy tokens through
the engine in bfloat16, and it steps aside, to the eager path, wherever it cannot take a step."""
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from unmask.engine.compiled_step import (MAX_WIDTH, MAX_WIDTH_ALONE, CompiledStep, cache_capacity,
                                         compile_step_requested, not_compilable)
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.engine.speculative import draft_layout
from unmask.models.attention import AttentionBatch, KVCache, Segment
from unmask.models.cpu_linear import pack_linears
from unmask.models.kv_int8 import Int8KVCache
from unmask.models.transformer import ArchConfig, DiffusionTransformer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "bench/models/unmask-tiny-5m"


def _model(dtype=torch.float32) -> DiffusionTransformer:
    torch.manual_seed(0)
    cfg = ArchConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, max_position=1024)
    model = DiffusionTransformer(cfg).to(dtype).eval().requires_grad_(False)
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    pack_linears(model)   # as LLM loads it: the compiled trace must step around the packed oneDNN products
    return model


@pytest.fixture(scope="module")
def shared() -> CompiledStep:
    """One compiled step over `_model()` for the tests that need no fresh one: each row count compiles once in the
    module (seconds each), as in an engine."""
    return CompiledStep(_model())


def _counts(step: CompiledStep) -> tuple[int, int]:
    return step.compiles, step.runs


def _filled_cache(model, capacity: int, length: int) -> KVCache:
    """A cache whose first `length` positions hold the K/V of a real prompt (an eager causal pass)."""
    cache = model.new_cache(capacity=capacity, max_capacity=capacity)
    for t in cache.k + cache.v:
        t.zero_()
    ids = torch.randint(4, 300, (length,))
    seg = Segment(start=0, length=length, write=length, cache=cache,
                  attend=torch.ones(length, length, dtype=torch.bool).tril())
    batch = AttentionBatch([seg]).prepare()
    model(ids, torch.arange(length), batch)
    cache.length = length
    return cache


def _segments(model):
    """Two requests at once, as a self-speculative step and a block step feed them."""
    a = _filled_cache(model, 256, 37)
    b = _filled_cache(model, 512, 300)
    attend = draft_layout(1, 3, [4], [3])                     # T=1, D=3, one draft block of 4 (8 tokens)
    seg_a = Segment(start=37, length=8, write=4, cache=a, attend=attend)
    seg_b = Segment(start=300, length=11, write=3,           # a finished block's 3 tokens, then an 8-token block
                    cache=b, block_ids=torch.tensor([0, 1, 2] + [3] * 8))
    ids = torch.randint(4, 300, (19,))
    pos = torch.cat([torch.tensor([37, 38, 39, 40, 40, 41, 42, 43]), torch.arange(300, 311)])
    rows = [torch.tensor([0, 1, 2, 3, 4, 5, 6]), torch.arange(3, 11)]
    return [seg_a, seg_b], ids, pos, rows


def _eager(model, segs, ids, pos, rows):
    batch = AttentionBatch([Segment(s.start, s.length, s.write, cache=s.cache, block_ids=s.block_ids,
                                    attend=s.attend) for s in segs]).prepare()
    hidden = model(ids, pos, batch)
    offsets = torch.tensor([0] + [s.length for s in segs]).cumsum(0)
    return model.logits(hidden[torch.cat([r + o for r, o in zip(rows, offsets)])])


def test_compiled_logits_match_the_eager_forward_for_every_layout(shared):
    step, model = shared, shared.model
    segs, ids, pos, rows = _segments(model)
    for s in segs:   # the eager reference first, on the same caches (it writes the same K/V)
        s.cache.length = s.start
    ref = _eager(model, segs, ids, pos, rows)
    batch = AttentionBatch(segs).prepare()
    key = step.key(batch, [r.numel() for r in rows])
    assert key == (2, 16, 8)       # 2 rows, padded to 16 tokens, 8 logit rows each
    out = step.run(key, ids, pos, batch, rows)
    compiles, runs = _counts(step)
    assert out.shape == ref.shape == (15, 300) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    # the kept K/V are the eager ones (the next step reads them), and a second run replays without compiling
    for s in segs:
        s.cache.length = s.start
    again = step.run(key, ids, pos, batch, rows)
    torch.testing.assert_close(again, ref, atol=2e-4, rtol=1e-4)
    assert _counts(step) == (compiles, runs + 1) and 2 in step.compiled


def test_three_requests_run_as_four_rows_and_the_padding_row_is_dropped():
    """Row counts are padded to a power of two (fewer shapes to compile): the fourth row is token 0 over a scratch
    cache of its own, and only the three requests' logits come back, the eager forward's."""
    model = _model()
    segs, ids, pos, rows = _segments(model)
    third = Segment(start=20, length=5, write=5, cache=_filled_cache(model, 128, 20),
                    attend=torch.ones(5, 5, dtype=torch.bool).tril())
    segs, ids = segs + [third], torch.cat([ids, torch.randint(4, 300, (5,))])
    pos, rows = torch.cat([pos, torch.arange(20, 25)]), rows + [torch.tensor([4])]
    for s in segs:
        s.cache.length = s.start
    ref = _eager(model, segs, ids, pos, rows)
    step = CompiledStep(model)
    batch = AttentionBatch(segs).prepare()
    key = step.key(batch, [r.numel() for r in rows])
    assert key == (4, 16, 8)
    out = step.run(key, ids, pos, batch, rows)
    assert out.shape == (16, 300)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)


def test_a_prompt_forward_runs_through_the_code_compiled_for_decode_steps(shared):
    """A request alone may feed up to MAX_WIDTH_ALONE tokens: its 300-token prompt (token-causal, write-all) and
    then an 8-token decode step over the K/V it wrote, both through the one-row function, both the eager
    forward's logits."""
    step, model = shared, shared.model
    assert step.warm(1)
    compiles, runs = _counts(step)
    cache, ref_cache = _filled_cache(model, 448, 0), _filled_cache(model, 448, 0)
    ids = torch.randint(4, 300, (308,))
    attend = torch.ones(300, 300, dtype=torch.bool).tril()
    steps = [(0, 300, attend, torch.arange(290, 300)), (300, 8, draft_layout(1, 3, [4], [3]), torch.arange(7))]
    for start, n, mask, sel in steps:
        seg = Segment(start=start, length=n, write=n, cache=cache, attend=mask)
        ref_seg = Segment(start=start, length=n, write=n, cache=ref_cache, attend=mask)
        pos = torch.arange(start, start + n)
        want = _eager(model, [ref_seg], ids[start:start + n], pos, [sel])
        ref_cache.length = start + n
        batch = AttentionBatch([seg]).prepare()
        key = step.key(batch, [sel.numel()])
        assert key == (1, -(-n // 8) * 8, -(-sel.numel() // 8) * 8)
        torch.testing.assert_close(step.run(key, ids[start:start + n], pos, batch, [sel]), want, atol=2e-4, rtol=1e-4)
        cache.length = start + n
    assert _counts(step) == (compiles, runs + 2)   # no compile after warm: the 304-token step runs the same code


def test_warmed_on_padding_rows_the_code_serves_real_ones():
    """`warm` compiles a row count before any step meets it (a server's start), tracing padding rows over fresh
    caches of 512: the code it makes gives the eager logits for real rows over caches of 256 and 512, without
    compiling again."""
    model = _model()
    segs, ids, pos, rows = _segments(model)
    for s in segs:
        s.cache.length = s.start
    ref = _eager(model, segs, ids, pos, rows)
    step = CompiledStep(model)
    assert step.warm(2) and (step.compiles, step.runs) == (1, 0)
    batch = AttentionBatch(segs).prepare()
    key = step.key(batch, [r.numel() for r in rows])
    torch.testing.assert_close(step.run(key, ids, pos, batch, rows), ref, atol=2e-4, rtol=1e-4)
    assert (step.compiles, step.runs) == (1, 1)


def test_one_compiled_forward_serves_every_width_and_count_of_logit_rows(shared):
    """W (tokens a row feeds, padded to 8s) and K (logit rows) are symbols of the code: a step of 8 tokens with 8
    logit rows, then 24 with 16, then 40 with 40, all through the function compiled by the first, each the eager
    forward's."""
    step, model = shared, shared.model
    step.warm(1)
    compiles, runs = _counts(step)
    for n, m in ((7, 7), (20, 13), (37, 37)):
        cache = _filled_cache(model, 256, 30)
        seg = Segment(start=30, length=n, write=n, cache=cache, attend=torch.ones(n, n, dtype=torch.bool).tril())
        ids, pos, sel = torch.randint(4, 300, (n,)), torch.arange(30, 30 + n), torch.arange(n - m, n)
        want = _eager(model, [seg], ids, pos, [sel])
        cache.length = 30
        batch = AttentionBatch([seg]).prepare()
        key = step.key(batch, [m])
        assert key[1:] == (-(-n // 8) * 8, -(-m // 8) * 8)
        torch.testing.assert_close(step.run(key, ids, pos, batch, [sel]), want, atol=2e-4, rtol=1e-4)
    assert _counts(step) == (compiles, runs + 3)


def test_two_rows_compiled_with_equal_cache_lengths_serve_unequal_ones():
    """Compiled when both caches were 256 long, the same shape then runs rows of 256 and 704: each row's length is
    its own symbol (no duck sizing), so nothing assumes them equal."""
    model = _model()
    step = CompiledStep(model)
    attend = draft_layout(1, 3, [4], [3])
    ids = torch.randint(4, 300, (16,))
    pos = torch.tensor([37, 38, 39, 40, 40, 41, 42, 43] * 2)
    rows = [torch.arange(7), torch.arange(7)]
    for caps in ((256, 256), (256, 704)):
        segs = [Segment(start=37, length=8, write=4, cache=_filled_cache(model, c, 37), attend=attend) for c in caps]
        want = _eager(model, segs, ids, pos, rows)
        for seg in segs:
            seg.cache.length = 37
        batch = AttentionBatch(segs).prepare()
        key = step.key(batch, [7, 7])
        torch.testing.assert_close(step.run(key, ids, pos, batch, rows), want, atol=2e-4, rtol=1e-4)
    assert (step.compiles, step.runs) == (1, 2)


def test_one_request_alone_takes_its_own_shape_and_matches(shared):
    step, model = shared, shared.model
    segs, ids, pos, rows = _segments(model)
    seg, ids1, pos1, rows1 = segs[0], ids[:8], pos[:8], rows[:1]
    seg.cache.length = seg.start
    ref = _eager(model, [seg], ids1, pos1, rows1)
    batch = AttentionBatch([seg]).prepare()
    key = step.key(batch, [7])
    assert key == (1, 8, 8)
    torch.testing.assert_close(step.run(key, ids1, pos1, batch, rows1), ref, atol=2e-4, rtol=1e-4)
    compiles, runs = _counts(step)
    # the same step over a cache four times as long takes the same compiled code: its length is a symbol of it
    longer = _filled_cache(model, 1024, 37)
    seg2 = Segment(start=37, length=8, write=4, cache=longer, attend=seg.attend)
    want = _eager(model, [seg2], ids1, pos1, rows1)
    longer.length = 37
    batch2 = AttentionBatch([seg2]).prepare()
    assert step.key(batch2, [7]) == key
    torch.testing.assert_close(step.run(key, ids1, pos1, batch2, rows1), want, atol=2e-4, rtol=1e-4)
    assert _counts(step) == (compiles, runs + 1)


def test_steps_it_cannot_take_go_to_the_eager_path():
    model = _model()
    step = CompiledStep(model)
    cache = _filled_cache(model, 256, 10)
    wide = Segment(start=10, length=MAX_WIDTH + 1, write=0, cache=_filled_cache(model, 1024, 10))
    assert step.key(AttentionBatch([wide]).prepare(), [1]) == (1, 72, 8)               # alone: compiled
    assert step.key(AttentionBatch([wide]).prepare(), [0]) == (1, 72, 8)               # write-only: K never 0
    other = Segment(start=10, length=4, cache=cache)
    assert step.key(AttentionBatch([wide, other]).prepare(), [1, 4]) is None            # beside another: eager
    widest = Segment(start=10, length=MAX_WIDTH_ALONE + 1, write=0, cache=_filled_cache(model, 1024, 10))
    assert step.key(AttentionBatch([widest]).prepare(), [1]) is None                    # a long prompt's chunk
    assert step.key(AttentionBatch([Segment(start=10, length=4, suffix=2, cache=cache)]).prepare(), [4]) is None
    near_end = Segment(start=250, length=4, cache=_filled_cache(model, 256, 250))
    assert step.key(AttentionBatch([near_end]).prepare(), [4]) is None                  # no room for its padding
    huge = Segment(start=10, length=4, cache=_filled_cache(model, 8256, 10))
    assert step.key(AttentionBatch([huge]).prepare(), [4]) is None                      # past MAX_CAPACITY
    int8 = Int8KVCache([(2, 16)] * 2, "cpu", 256, 256)
    assert step.key(AttentionBatch([Segment(start=0, length=4, cache=int8)]).prepare(), [4]) is None
    assert step.compiles == 0


def test_which_models_it_takes():
    assert not_compilable(_model(torch.bfloat16)) is None
    assert "float32 weights" in not_compilable(_model())
    adapted = _model(torch.bfloat16)
    from unmask.models.draft_adapter import DraftAdapterConfig

    adapted.enable_draft_adapter(DraftAdapterConfig(rank=4, alpha=8, mask_id=3))
    assert "draft adapters" in not_compilable(adapted)
    # requests get one buffer with room for a padded step, in whole 64s; long contexts keep the eager path's cache
    assert cache_capacity(100) == 192 and cache_capacity(200) == 320 and cache_capacity(8128) == 8192
    assert cache_capacity(8129) is None


def test_the_switch(monkeypatch):
    from unmask.cli_util import static_step_options

    monkeypatch.delenv("UNMASK_COMPILE_STEP", raising=False)
    assert not compile_step_requested() and compile_step_requested(True)
    options = lambda flag, serving: static_step_options(None, None, None, None, flag, serving=serving)["compile_step"]
    # unmask serve: the one-request step where it can be; unmask generate: off; a flag or the variable wins
    assert (options(None, True), options(None, False), options(False, True), options(True, False)) == (
        "auto", False, False, True)
    monkeypatch.setenv("UNMASK_COMPILE_STEP", "1")
    assert compile_step_requested() is True and not compile_step_requested(False)
    monkeypatch.setenv("UNMASK_COMPILE_STEP", "auto")
    assert compile_step_requested() == "auto" and options(None, False) == "auto"
    monkeypatch.setenv("UNMASK_COMPILE_STEP", "0")
    assert options(None, True) is False


def test_without_compile_when_met_only_warmed_row_counts_run_compiled(shared):
    """The server's default ("auto") compiles the one-request forward at start and never another: a step of
    three requests runs eagerly (run returns None) rather than waiting for a compile."""
    model = shared.model
    segs, ids, pos, rows = _segments(model)
    third = Segment(start=20, length=5, write=5, cache=_filled_cache(model, 128, 20),
                    attend=torch.ones(5, 5, dtype=torch.bool).tril())
    segs, ids = segs + [third], torch.cat([ids, torch.randint(4, 300, (5,))])
    pos, rows = torch.cat([pos, torch.arange(20, 25)]), rows + [torch.tensor([4])]
    batch = AttentionBatch(segs).prepare()
    key = shared.key(batch, [r.numel() for r in rows])
    compiles, runs = _counts(shared)
    shared.compile_when_met = False
    try:
        assert key[0] not in shared.compiled and shared.run(key, ids, pos, batch, rows) is None
    finally:
        shared.compile_when_met = True
    assert _counts(shared) == (compiles, runs) and key[0] not in shared.compiled


def test_the_servers_default_leaves_float32_eager_with_a_note_not_a_warning(caplog):
    with caplog.at_level("INFO", logger="unmask.engine"):
        llm = LLM(MODEL, dtype="float32", device="cpu", compile_step="auto")
    assert llm.engine.runner.compiled is None
    notes = [r for r in caplog.records if "compiled CPU step not used: float32 weights" in r.getMessage()]
    assert notes and all(r.levelname == "INFO" for r in notes)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    shorter = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), shorter)


def test_the_engine_in_bfloat16_writes_the_eager_tokens():
    """The 5.25M model, greedy, its default policy (self-speculative, block 4; the threshold rule's block layout
    is in the first test): the same tokens with the compiled step as without, up to where the eager model's two
    most likely tokens were within bfloat16's rounding of each other (the compiled forward rounds in other
    places: logits within ~0.13). The engine compiles the one-request step when it starts."""
    eager = LLM(MODEL, dtype="bfloat16", device="cpu")
    compiled = LLM(MODEL, dtype="bfloat16", device="cpu", compile_step=True)
    step = compiled.engine.runner.compiled
    assert step is not None and eager.engine.runner.compiled is None
    assert (step.compiles, step.runs) == (1, 0)   # warmed at start
    prompt = compiled.encode("def add(a, b):\n    return")
    params = GenerationParams(max_tokens=24, logprobs=True, top_logprobs=2, policy="speculative", block_size=4)
    want = eager.generate([prompt], [params])[0]
    got = compiled.generate([prompt], [params])[0]
    i = _first_difference(got.token_ids, want.token_ids)
    if i is None:   # what this machine gives
        assert len(got.token_ids) == 24
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=0.15, rtol=0)
    else:   # a near tie: the eager step's top two log-probabilities within bf16 rounding
        (_, first), (_, second) = want.top_logprobs[i][:2]
        assert first - second < 0.1, (i, want.top_logprobs[i])
    assert step.runs > 0 and step.compiles == 1 and not step.failed


def test_float32_asks_are_refused_with_the_reason(caplog):
    with caplog.at_level("WARNING", logger="unmask.engine"):
        llm = LLM(MODEL, dtype="float32", device="cpu", compile_step=True)
    assert llm.engine.runner.compiled is None
    assert "compiled CPU step not used: float32 weights" in caplog.text


def test_generate_takes_the_flag_and_a_bad_variable_is_one_line(monkeypatch):
    from unmask.cli import app

    runner = CliRunner()
    monkeypatch.setenv("UNMASK_COMPILE_STEP", "maybe")
    r = runner.invoke(app, ["generate", "--model", str(MODEL), "hi"])
    assert r.exit_code == 1 and r.stderr.strip() == ("error: UNMASK_COMPILE_STEP must be one of 1, true, yes, on, 0, "
                                                     "false, no, off, auto, got 'maybe'"), r.output

