"""Fast-dLLM v2 sub-blocks (`small_block_size`): the window rule on hand-made canvases, exact step counts on a
model-free canvas, the engine against the naive dense loop, and the request checks up to the server's 400."""
import time

import pytest
import torch

from fake_canvas import SURE, UNSURE, drive
from naive_decode import naive_generate
from unmask.decoding.targets import decode_window
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError
from unmask.models.loader import load_model

FAMILIES = ["sdar", "fast_dllm_v2", "llada2"]  # the block-causal public families
PROMPTS = [list(range(20, 33)), list(range(40, 45)), list(range(50, 58))]  # mid-block, short, aligned


@pytest.fixture(scope="module")
def models(family_dirs):
    return {f: load_model(family_dirs[f]) for f in FAMILIES + ["llada"]}


def run(model, spec, prompts, params):
    eng = Engine(model, spec, max_num_seqs=16)
    seqs = [eng.add_request(p, params) for p in prompts]
    eng.run_to_completion()
    return seqs


# ------------------------------------------------------------------------------------------ the window rule
def test_the_window_is_the_leftmost_subblock_with_a_mask():
    M = 0
    seq = torch.tensor([7, 7, 7, 7, 7, 7, 7, 7, 7, M, 7, M, M, M, 7, M])
    assert decode_window(seq, 4, 16, M, None) == (4, 16)
    assert decode_window(seq, 4, 16, M, 4) == (8, 12)     # [4, 8) is complete
    assert decode_window(seq, 4, 16, M, 2) == (8, 10)
    assert decode_window(seq, 4, 16, M, 6) == (4, 10)     # aligned to the block start, not to 0
    assert decode_window(seq, 12, 15, M, 2) == (12, 14)   # a last block cut short by max_tokens
    assert decode_window(seq, 0, 8, M, 4) == (4, 8)       # no mask left: the last sub-block, nothing in it


# ------------------------------------------------------------------------------------------ model-free canvas
@pytest.mark.parametrize("small, forwards", [(None, 2), (8, 2), (4, 4), (2, 8), (1, 16)])
def test_every_subblock_takes_its_own_forward(small, forwards):
    """Every row clears the threshold: a step commits its whole window, so 16 tokens in blocks of 8 take
    16 / (window size) forwards, the windows in order."""
    params = GenerationParams(max_tokens=16, threshold=0.9, ignore_eos=True, small_block_size=small)
    seq, committed = drive(params, [5] * 16, [SURE] * 16)
    size = small or 8
    assert seq.stats.forwards == forwards and seq.finish_reason == "length"
    assert committed == [list(range(i, i + size)) for i in range(0, 16, size)]


@pytest.mark.parametrize("small, order", [
    (None, [7, 6, 5, 4, 3, 2, 1, 0]),   # the whole block: the most confident row anywhere in it
    (4, [3, 2, 1, 0, 7, 6, 5, 4]),      # the most confident row of the leftmost unfinished sub-block
    (2, [1, 0, 3, 2, 5, 4, 7, 6]),
])
def test_threshold_still_commits_one_row_per_step_inside_the_window(small, order):
    """No row clears the threshold and confidence grows to the right: the rule's forced best row is one per step,
    chosen inside the window only."""
    params = GenerationParams(max_tokens=8, threshold=0.9, ignore_eos=True, small_block_size=small)
    seq, committed = drive(params, [5] * 8, [UNSURE + 0.1 * i for i in range(8)])
    assert committed == [[i] for i in order]
    assert seq.stats.forwards == 8 and seq.output_ids == [5] * 8


@pytest.mark.parametrize("small, committed", [(None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
                                               (4, [[0, 1], [2, 3], [4, 5], [6, 7]])])
def test_a_schedule_runs_per_subblock(small, committed):
    """low_confidence with steps=2 splits each window's masks over two steps: per block without sub-blocks,
    per sub-block with them (so twice the forwards)."""
    params = GenerationParams(max_tokens=8, policy="low_confidence", steps=2, ignore_eos=True,
                              small_block_size=small)
    seq, got = drive(params, [5] * 8, [UNSURE + 0.1 * (8 - i) for i in range(8)])
    assert got == committed and seq.stats.forwards == len(committed)


# ------------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["threshold", "low_confidence"])
def test_a_subblock_as_large_as_the_block_changes_nothing(family, policy, models):
    model, spec = models[family]
    base = dict(max_tokens=13, policy=policy, threshold=0.3, steps=2, block_size=4, seed=0)
    off = run(model, spec, PROMPTS, GenerationParams(**base))
    same = run(model, spec, PROMPTS, GenerationParams(**base, small_block_size=4))
    assert [s.output_ids for s in same] == [s.output_ids for s in off]
    assert [s.stats.forwards for s in same] == [s.stats.forwards for s in off]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size, small", [(4, 2), (8, 2), (8, 4)])
def test_subblocks_match_the_naive_loop(family, block_size, small, models):
    model, spec = models[family]
    params = GenerationParams(max_tokens=13, threshold=0.3, block_size=block_size, small_block_size=small, seed=0)
    for p, s in zip(PROMPTS, run(model, spec, PROMPTS, params)):
        assert s.output_ids == naive_generate(model, spec, p, params), (family, p)
        assert len(s.output_ids) == 13 or s.finish_reason == "stop"


# ------------------------------------------------------------------------------------------ request checks
@pytest.mark.parametrize("kw, message", [
    (dict(block_size=8, small_block_size=3), "small_block_size (3) must divide the block size (8)"),
    (dict(small_block_size=0), "small_block_size must be a positive integer, got 0"),
    (dict(small_block_size=True), "small_block_size must be a positive integer, got True"),
    (dict(small_block_size=2.0), "small_block_size must be a positive integer, got 2.0"),
])
def test_bad_small_block_sizes_name_the_field(kw, message):
    with pytest.raises(InvalidRequestError) as e:
        GenerationParams(**kw)
    assert str(e.value) == message and e.value.param == "small_block_size"


def test_the_engine_checks_against_the_models_block_size_and_family(models):
    model, spec = models["sdar"]
    assert spec.block_size == 4
    eng = Engine(model, spec)
    with pytest.raises(InvalidRequestError, match=r"small_block_size \(8\) must divide the block size \(4\)") as e:
        eng.check_request([20, 21], GenerationParams(small_block_size=8))
    assert e.value.param == "small_block_size"
    eng.check_request([20, 21], GenerationParams(small_block_size=8, block_size=16))  # the request's own block
    llada, llada_spec = models["llada"]
    with pytest.raises(InvalidRequestError, match="needs a block-causal family") as e:
        Engine(llada, llada_spec).add_request([20, 21], GenerationParams(small_block_size=2, block_size=4))
    assert e.value.param == "small_block_size"


def test_the_server_takes_small_block_size_and_answers_400_naming_it(family_dirs):
    """Through the HTTP app in-process: the extension field reaches the engine (the same tokens as LLM.generate
    with it) and a size that does not divide the model's block is a 400 whose param names it."""
    from fastapi.testclient import TestClient

    from unmask.engine.llm import LLM
    from unmask.server.app import ServerArgs, create_app

    body = {"model": "tiny", "prompt": [20, 21, 22], "max_tokens": 8, "temperature": 0.0, "threshold": 0.3,
            "small_block_size": 2, "ignore_eos": True}
    with TestClient(create_app(ServerArgs(model=family_dirs["sdar"], served_model_name="tiny"))) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not load"
            time.sleep(0.05)
        ok = client.post("/v1/completions", json=body)
        bad = client.post("/v1/completions", json={**body, "small_block_size": 3})
    assert ok.status_code == 200, ok.text
    want = LLM(family_dirs["sdar"]).generate([[20, 21, 22]], GenerationParams(
        max_tokens=8, threshold=0.3, small_block_size=2, ignore_eos=True))[0]
    assert ok.json()["choices"][0]["text"] == want.text and ok.json()["usage"]["completion_tokens"] == 8
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "small_block_size"
    assert "must divide the block size (4)" in bad.json()["error"]["message"]
