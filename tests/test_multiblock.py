"""Multi-block decoding (`multi_block_threshold`, D2F / d3LLM): once the active block is committed enough, the next
block's masks are decoded in the same forward, one bidirectional group over the exact cache of earlier blocks.

The model-free canvas gives exact commits, forwards and cache writes; the tiny causal-context model checks the
engine against the naive dense loop."""
import pytest

from fake_canvas import STOP, SURE, UNSURE, drive
from naive_decode import naive_generate
from test_engine import make_unmask_shifted
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError
from unmask.models.loader import load_model

PROMPTS = [list(range(20, 33)), list(range(40, 45)), list(range(50, 58))]  # mid-block, short, aligned


def after(needs: dict[int, range], n: int):
    """Scores for the canvas: index i is sure once every index in needs[i] is committed (always without an entry),
    else unsure (lower to the right, so a forced row is the leftmost)."""
    def scores(out) -> list[float]:
        known = out != 0
        return [SURE if all(known[j] for j in needs.get(i, ())) else UNSURE - 0.01 * i for i in range(n)]
    return scores


def params(tau: float | None, max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, threshold=0.9, ignore_eos=True, multi_block_threshold=tau)


# the second half of each block follows from its first half; the next block's first half from this block's
HALVES = {**{i: range(0, 4) for i in range(4, 12)}, **{i: range(8, 12) for i in range(12, 16)}}


@pytest.mark.parametrize("tau, committed, writes", [
    (None, [range(0, 4), range(4, 8), range(8, 12), range(12, 16)], [8, 0, 8, 0]),
    (0.75, [range(0, 4), range(4, 8), range(8, 12), range(12, 16)], [8, 0, 8, 0]),  # half committed: not yet
    (0.5, [range(0, 4), range(4, 12), range(12, 16)], [8, 0, 8]),
])
def test_the_next_block_opens_at_the_threshold(tau, committed, writes):
    """Blocks of 8 after an 8-token prompt. With tau 0.5 the first step commits half of block 0, so the second
    step decodes blocks 0 and 1 together: 3 forwards instead of 4. The open block is fed, never written."""
    plans = []
    seq, got = drive(params(tau, 16), [5] * 16, after(HALVES, 16), causal_context=True, plans=plans)
    assert got == [list(r) for r in committed] and seq.stats.forwards == len(committed)
    assert [p.segment.write for p in plans] == writes and seq.output_ids == [5] * 16
    if tau == 0.5:  # positions 16..31 (both blocks) in one group; the prompt written before, nothing since
        two = plans[1]
        assert (two.segment.start, two.segment.length) == (8, 16) and set(two.segment.block_ids.tolist()) == {8}
        assert two.targets.tolist() == list(range(12, 24))


def test_a_block_finished_while_the_one_before_was_open_is_skipped():
    """Block 1 is decoded entirely alongside block 0's second half: both complete in one step, the engine moves
    past both and the next forward writes their 16 tokens at once."""
    needs = {**{i: range(0, 4) for i in range(4, 16)}, **{i: range(8, 16) for i in range(16, 24)}}
    plans = []
    seq, got = drive(params(0.5, 24), [5] * 24, after(needs, 24), causal_context=True, plans=plans)
    assert got == [list(range(0, 4)), list(range(4, 16)), list(range(16, 24))]
    assert [p.segment.write for p in plans] == [8, 0, 16] and seq.finish_reason == "length"
    plain, _ = drive(params(None, 24), [5] * 24, after(needs, 24), causal_context=True)
    assert plain.stats.forwards == 4


def test_a_stop_in_the_open_block_caps_it():
    """The stop at index 10 (in the open block 1) is committed while block 0 still has holes: indices 12..15 are
    not decoded, and the request ends at index 10 once block 0 is filled."""
    tokens = [5] * 10 + [STOP] + [5] * 5
    needs = {**{i: range(8, 9) for i in range(4, 8)}, **{i: range(0, 4) for i in range(8, 12)},
             **{i: range(4, 8) for i in range(12, 16)}}
    seq, got = drive(GenerationParams(max_tokens=16, threshold=0.9, multi_block_threshold=0.5), tokens,
                     after(needs, 16), causal_context=True)
    assert got == [list(range(0, 4)), list(range(8, 12)), list(range(4, 8))]
    assert seq.output_ids == [5] * 10 and seq.finish_reason == "stop"


# ------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    return load_model(make_unmask_shifted(tmp_path_factory.mktemp("unmask") / "c", causal_context=True))


@pytest.mark.parametrize("tau", [0.25, 0.5])
@pytest.mark.parametrize("policy", ["threshold", "credit", "topk"])
def test_multi_block_matches_the_naive_loop(tau, policy, causal):
    model, spec = causal
    p = GenerationParams(max_tokens=13, policy=policy, threshold=0.3, block_size=4, seed=0,
                         multi_block_threshold=tau, tokens_per_step=2)
    eng = Engine(model, spec, max_num_seqs=16)
    seqs = [eng.add_request(prompt, p) for prompt in PROMPTS]
    eng.run_to_completion()
    for prompt, s in zip(PROMPTS, seqs):
        assert s.output_ids == naive_generate(model, spec, prompt, p), prompt


@pytest.mark.parametrize("ordered", [False, True])
def test_multi_block_with_stop_tokens_matches_the_naive_loop(causal, ordered):
    model, spec = causal
    base = dict(max_tokens=16, threshold=0.3, block_size=4, seed=0, multi_block_threshold=0.25, ordered_stops=ordered)
    eng = Engine(model, spec)
    free = eng.add_request(PROMPTS[0], GenerationParams(**base, ignore_eos=True))
    eng.run_to_completion()
    for k in (2, 5, 9):
        p = GenerationParams(**base, stop_token_ids=[free.output_ids[k]])
        eng = Engine(model, spec)
        s = eng.add_request(PROMPTS[0], p)
        eng.run_to_completion()
        want = naive_generate(model, spec, PROMPTS[0], p)
        assert s.output_ids == want
        # in order, a stop proposed early waits, so the free run's stop token may never be committed
        assert s.finish_reason == ("stop" if len(want) < p.max_tokens else "length")
        if not ordered:
            assert s.finish_reason == "stop"


# ------------------------------------------------------------------------------------------ request checks
@pytest.mark.parametrize("kw, message", [
    (dict(multi_block_threshold=0), "multi_block_threshold must be in (0, 1], got 0"),
    (dict(multi_block_threshold=1.5), "multi_block_threshold must be in (0, 1], got 1.5"),
    (dict(multi_block_threshold="0.5"), "multi_block_threshold must be in (0, 1], got '0.5'"),
    (dict(multi_block_threshold=0.5, small_block_size=2), "cannot be combined with small_block_size"),
    (dict(multi_block_threshold=0.5, policy="low_confidence"), "needs a policy without a per-block schedule"),
])
def test_bad_multi_block_requests_name_the_field(kw, message):
    with pytest.raises(InvalidRequestError) as e:
        GenerationParams(**kw)
    assert message in str(e.value) and e.value.param == "multi_block_threshold"


def test_only_causal_context_models_take_multi_block(family_dirs, causal):
    model, spec = load_model(family_dirs["sdar"])
    with pytest.raises(InvalidRequestError, match="needs a block-causal model with a causal context") as e:
        Engine(model, spec).check_request([20, 21], GenerationParams(multi_block_threshold=0.5))
    assert e.value.param == "multi_block_threshold"
    Engine(*causal).check_request([20, 21], GenerationParams(multi_block_threshold=0.5))


def test_the_server_passes_multi_block_threshold_through():
    from unmask.server.protocol import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], multi_block_threshold=0.6)
    assert chat.generation_kwargs()["multi_block_threshold"] == 0.6
    assert CompletionRequest(prompt="hi", multi_block_threshold=0.6).generation_kwargs()["multi_block_threshold"] == 0.6
