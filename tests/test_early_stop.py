"""The early stop of a block: once a stop token is committed, only the holes before it are decoded.

The model-free canvas gives exact forward counts; the `ignore_eos` run of the same canvas is the trajectory the
rule before this one followed (it targeted every mask of the block until the holes before the stop were filled),
so the forwards saved are counted against it. The tiny models check the engine against the naive dense loop."""
import pytest
import torch

from fake_canvas import RUNNER_UP, STOP, SURE, UNSURE, drive
from naive_decode import naive_generate
from unmask.decoding.targets import first_stop
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams

ONE_PER_STEP = dict(max_tokens=8, policy="topk", tokens_per_step=1)


def test_first_stop_finds_the_earliest_stop_token():
    seq = torch.tensor([7, 7, 0, 3, 7, 0])
    assert first_stop(seq, 0, 6, torch.tensor([7])) == 0
    assert first_stop(seq, 2, 6, torch.tensor([3, 7])) == 3
    assert first_stop(seq, 5, 6, torch.tensor([3, 7])) == 6                    # none: the end of the range
    assert first_stop(seq, 0, 6, torch.tensor([], dtype=torch.long)) == 6      # ignore_eos and no stop ids


def forwards_until_done(committed: list[list[int]], upto: int) -> int:
    """Forwards until every output index below `upto` is committed (when the old rule finished)."""
    done: set[int] = set()
    for n, step in enumerate(committed, 1):
        done.update(step)
        if done >= set(range(upto)):
            return n
    raise AssertionError("never complete")


def test_a_stop_before_holes_stops_decoding_the_rest_of_the_block():
    """The stop token at index 5 is the most confident, then indices 7 and 6, then 0..4: the old rule spent two
    forwards on 7 and 6 (after the stop, never output); now they are not decoded. Same tokens, 6 forwards not 8."""
    tokens = [5, 6, 7, 8, 9, STOP, 10, 11]
    scores = [UNSURE + 0.5 - 0.1 * i for i in range(5)] + [SURE, SURE - 2, SURE - 1]
    seq, committed = drive(GenerationParams(**ONE_PER_STEP), tokens, scores)
    assert committed == [[5], [0], [1], [2], [3], [4]]
    assert seq.output_ids == [5, 6, 7, 8, 9] and seq.finish_reason == "stop" and seq.stats.forwards == 6
    old, old_committed = drive(GenerationParams(**ONE_PER_STEP, ignore_eos=True), tokens, scores)
    assert old_committed[:3] == [[5], [7], [6]]
    assert forwards_until_done(old_committed, 5) == 8 and old.output_ids[:5] == seq.output_ids


def test_a_stop_committed_last_in_order_changes_nothing():
    """Left to right, one per step: nothing after the stop is ever a candidate before it, as before."""
    tokens = [5, 6, 7, 8, 9, STOP, 10, 11]
    scores = [SURE - 0.5 * i for i in range(8)]
    seq, committed = drive(GenerationParams(**ONE_PER_STEP), tokens, scores)
    old, old_committed = drive(GenerationParams(**ONE_PER_STEP, ignore_eos=True), tokens, scores)
    assert committed == old_committed[:6] == [[i] for i in range(6)]
    assert seq.output_ids == old.output_ids[:5] == [5, 6, 7, 8, 9] and seq.stats.forwards == 6


def test_threshold_steps_fill_only_the_holes_before_the_stop():
    """Threshold 0.9: the first step commits every sure row (2, the stop at 3, 6, 7); the unsure 0, 1 and 5 are
    then one per step, and 5 is never decoded: 3 forwards, where decoding 5 too took 4."""
    tokens = [5, 6, 7, STOP, 8, 9, 10, 11]
    scores = [UNSURE + 0.2, UNSURE + 0.1, SURE, SURE, SURE, UNSURE + 0.3, SURE, SURE]
    seq, committed = drive(GenerationParams(max_tokens=8, threshold=0.9), tokens, scores)
    assert committed == [[2, 3, 4, 6, 7], [0], [1]]
    assert seq.output_ids == [5, 6, 7] and seq.stats.forwards == 3
    _, old_committed = drive(GenerationParams(max_tokens=8, threshold=0.9, ignore_eos=True), tokens, scores)
    assert old_committed == [[2, 3, 4, 6, 7], [5], [0], [1]]


@pytest.mark.parametrize("min_tokens, output, committed", [
    (0, [5, 6], [[2], [0], [1]]),
    # the stop at index 2 is banned (index 2 < 4): that row proposes its runner-up at low confidence instead
    (4, [5, 6, RUNNER_UP, 8, 9], [[5], [0], [1], [3], [4], [2]]),
])
def test_min_tokens_still_holds_back_early_stops(min_tokens, output, committed):
    tokens = [5, 6, STOP, 8, 9, STOP, 10, 11]
    scores = [UNSURE + 0.5, UNSURE + 0.4, SURE, UNSURE + 0.3, UNSURE + 0.2, SURE - 1, UNSURE, UNSURE]
    seq, got = drive(GenerationParams(**ONE_PER_STEP, min_tokens=min_tokens), tokens, scores)
    assert seq.output_ids == output and seq.finish_reason == "stop" and got == committed


def test_with_subblocks_the_stop_ends_its_subblock_and_the_block():
    """Sub-blocks of 4: the stop at index 2 leaves index 3 and the second sub-block undecoded."""
    tokens = [5, 6, STOP, 8, 9, 10, 11, 12]
    scores = [UNSURE + 0.2, UNSURE + 0.1, SURE, SURE - 1] + [SURE] * 4
    seq, committed = drive(GenerationParams(**ONE_PER_STEP, small_block_size=4), tokens, scores)
    assert committed == [[2], [0], [1]] and seq.output_ids == [5, 6] and seq.stats.forwards == 3


@pytest.mark.parametrize("family", ["sdar", "fast_dllm_v2", "llada2", "llada", "dream"])
def test_stop_tokens_match_the_naive_loop(family, family_dirs):
    """Stop ids taken from a free run's own tokens, so stops land mid-block, with and without sub-blocks."""
    from unmask.models.loader import load_model

    model, spec = load_model(family_dirs[family])
    prompt = list(range(20, 33))
    small = None if spec.family.attention == "bidirectional" else 2
    base = dict(max_tokens=16, threshold=0.3, block_size=8, seed=0)
    eng = Engine(model, spec)
    free = eng.add_request(prompt, GenerationParams(**base, ignore_eos=True))
    eng.run_to_completion()
    cases = [GenerationParams(**base, small_block_size=s, stop_token_ids=[free.output_ids[k]])
             for k in (3, 6, 10) for s in dict.fromkeys((None, small))]
    eng = Engine(model, spec)
    seqs = [eng.add_request(prompt, p) for p in cases]
    eng.run_to_completion()
    for p, s in zip(cases, seqs):
        assert s.finish_reason == "stop" and p.stop_token_ids[0] not in s.output_ids
        assert s.output_ids == naive_generate(model, spec, prompt, p), (p.stop_token_ids, p.small_block_size)
