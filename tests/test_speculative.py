"""Self-speculative decoding in the engine (policy `speculative`, unmask.engine.speculative): the output is exactly
the model's own next-token decoding (block size 1, one token per forward), in fewer forwards, alone or batched,
over the prefix cache and chunked prefill, with logprobs, stops and sampling; and refused where it cannot run."""
import inspect
import json
from pathlib import Path

import pytest
import torch

from unmask.engine.engine import Engine
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.engine.sequence import Status
from unmask.errors import InvalidRequestError

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "bench/models/unmask-tiny-5m"   # committed, trained: its drafts are often right
AR = dict(policy="topk", tokens_per_step=1, block_size=1)


def code_prompts() -> list[str]:
    """Openings of real Python functions (the standard library's, present on every machine)."""
    import json.decoder
    import textwrap

    out = []
    for fn in (textwrap.dedent, textwrap.indent, json.decoder.py_scanstring, inspect.getdoc, inspect.cleandoc,
               Path.with_suffix):
        src = inspect.getsource(fn)
        out.append(src[: src.index("\n", src.index(":\n") + 2) + 1])  # the def line(s) and the first body line
    return out


@pytest.fixture(scope="module")
def llm():
    torch.manual_seed(0)
    return LLM(MODEL, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.encode(p) for p in code_prompts()]


def one_by_one(llm, prompts, **knobs):
    return [llm.generate([p], GenerationParams(max_tokens=40, **knobs))[0] for p in prompts]


def memoised(llm, prompts):
    """one_by_one for the next-token references, each set of knobs decoded once per module: they are greedy, so
    the same every time, and several tests (each parameter of them) compare with the same one."""
    done = {}

    def reference(**knobs):
        key = repr(sorted(knobs.items()))
        if key not in done:
            done[key] = one_by_one(llm, prompts, **knobs)
        return done[key]
    return reference


@pytest.fixture(scope="module")
def reference(llm, prompts):
    return memoised(llm, prompts)


@pytest.mark.parametrize("all_outcomes,block", [(False, None), (True, None), (False, 4)])
def test_greedy_output_is_next_token_decoding_in_fewer_forwards(llm, prompts, reference, all_outcomes, block):
    ref = reference(**AR)
    got = one_by_one(llm, prompts, policy="speculative", draft_all_outcomes=all_outcomes, block_size=block)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    tokens = sum(len(o.token_ids) for o in got)
    # next-token decoding takes a forward per token (and the prefill); kept drafts save forwards
    assert sum(o.forwards for o in ref) >= tokens
    assert sum(o.forwards for o in got) < 0.9 * tokens


def test_batched_equals_alone_and_all_outcomes_need_no_more_forwards(llm, prompts):
    alone = one_by_one(llm, prompts, policy="speculative")
    batched = llm.generate(prompts, [GenerationParams(max_tokens=40, policy="speculative") for _ in prompts])
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    every = one_by_one(llm, prompts, policy="speculative", draft_all_outcomes=True)
    assert sum(o.forwards for o in every) <= sum(o.forwards for o in alone)


def test_prefix_cache_and_chunked_prefill_keep_the_output(llm, prompts):
    long_prompt = sum(prompts, [])[:300]
    ref = llm.generate([long_prompt], GenerationParams(max_tokens=24, **AR))[0].token_ids
    eng = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=4, max_batch_tokens=32)
    for _ in range(2):  # the second request reads the prompt's blocks from the prefix cache
        seq = eng.add_request(long_prompt, GenerationParams(max_tokens=24, policy="speculative"))
        eng.run_to_completion()
        assert seq.output_ids == ref
    assert eng.prefix_cache.hits >= (len(long_prompt) - 1) // llm.spec.block_size



@pytest.mark.parametrize("policy", [dict(policy="speculative"), dict(policy="threshold", threshold=0.9)])
def test_prefill_chunks_are_counted_apart_from_decoding_forwards(llm, prompts, policy):
    """A prompt longer than a step's token budget is written in chunks first: those forwards are the request's
    (`forwards`) but not decoding (`prefill_forwards`), so tokens per decoding forward do not depend on the budget."""
    long_prompt = sum(prompts, [])[:300]
    whole = llm.generate([long_prompt], GenerationParams(max_tokens=24, **policy))[0]
    assert whole.prefill_forwards == 0
    eng = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=4, max_batch_tokens=64, prefix_cache_bytes=0)
    kept, llm.engine = llm.engine, eng
    try:
        chunked = llm.generate([long_prompt], GenerationParams(max_tokens=24, **policy))[0]
    finally:
        llm.engine = kept
    assert chunked.token_ids == whole.token_ids
    # 64-token chunks, whole blocks, up to the prompt's last block (which rides with the first decoding forward)
    assert chunked.prefill_forwards == (len(long_prompt) - 1) // 64
    assert chunked.forwards == whole.forwards + chunked.prefill_forwards
    assert chunked.decoding_forwards == whole.decoding_forwards == whole.forwards


def test_a_long_prompt_takes_the_causal_kernels(llm, prompts, monkeypatch):
    """The prompt's write-only chunks are token-causal by block ids (no [n, n] mask, so attention takes the
    kernels' causal path), and the first drafting step marks its committed tokens and drafts as the causal prefix
    of its explicit layout (attention runs those rows apart from the draft blocks); the output is unchanged."""
    import unmask.models.transformer as transformer

    long_prompt = (sum(prompts, []) * 6)[:700]
    ref = llm.generate([long_prompt], GenerationParams(max_tokens=24, **AR))[0].token_ids
    segments = []
    real = transformer.ragged_attention

    def recording(q, k, v, batch, layer, *rest):
        if layer == 0:
            segments.extend((s.length, s.attend is not None, s.causal_rows, s.causal_prefix, s.write)
                            for s in batch.segments)
        return real(q, k, v, batch, layer, *rest)

    monkeypatch.setattr(transformer, "ragged_attention", recording)
    eng = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=1, max_batch_tokens=256, prefix_cache_bytes=0)
    seq = eng.add_request(long_prompt, GenerationParams(max_tokens=24, policy="speculative"))
    eng.run_to_completion()
    assert seq.output_ids == ref
    # 700 tokens at 256 a step: two chunks of 256, all rows causal, no explicit mask
    assert segments[:2] == [(256, False, 256, 0, 256)] * 2
    length, masked, _, prefix, write = segments[2]
    assert masked and prefix == write == 700 - 512 and length > prefix   # the rest of the prompt, then a block
    assert all(s[3] == s[4] for s in segments[2:])   # every step: committed tokens and drafts, then blocks


def test_stops_min_tokens_and_max_tokens_as_next_token_decoding(llm, prompts):
    knobs = dict(stop=["\n"], min_tokens=1, max_tokens=30)
    for p in prompts:
        ref = llm.generate([p], GenerationParams(**knobs, **AR))[0]
        got = llm.generate([p], GenerationParams(**knobs, policy="speculative"))[0]
        assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason)
    short = llm.generate([prompts[0]], GenerationParams(max_tokens=3, policy="speculative", ignore_eos=True))[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


def test_logprobs_are_the_next_token_rows(llm, prompts):
    ref = llm.generate([prompts[1]], GenerationParams(max_tokens=20, logprobs=True, top_logprobs=3, **AR))[0]
    got = llm.generate([prompts[1]], GenerationParams(max_tokens=20, logprobs=True, top_logprobs=3,
                                                      policy="speculative"))[0]
    assert got.token_ids == ref.token_ids
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
    assert [[t for t, _ in row] for row in got.top_logprobs] == [[t for t, _ in row] for row in ref.top_logprobs]


def test_sampling_is_seeded_and_keeps_drafts(llm, prompts):
    knobs = dict(max_tokens=40, policy="speculative", temperature=0.7, top_k=20, seed=11)
    a = llm.generate(prompts, [GenerationParams(**knobs) for _ in prompts])
    b = llm.generate(prompts, [GenerationParams(**knobs) for _ in prompts])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.forwards for o in a) < sum(len(o.token_ids) for o in a)


@pytest.mark.parametrize("knobs", [dict(frequency_penalty=0.5), dict(presence_penalty=0.8, frequency_penalty=-0.3),
                                   dict(repetition_penalty=1.3), dict(logit_bias={214: -4.0, 591: 2.0}),
                                   dict(dry_multiplier=0.8, dry_allowed_length=1),
                                   dict(dry_multiplier=1.5, frequency_penalty=0.3)])
def test_penalties_and_bias_as_next_token_decoding(llm, prompts, reference, knobs):
    """Verifier row i is penalised as if drafts 0..i-1 were committed: the output stays next-token decoding's
    under the same penalties, and the penalties do change it."""
    ref = one_by_one(llm, prompts, **AR, **knobs)
    got = one_by_one(llm, prompts, policy="speculative", draft_all_outcomes=True, **knobs)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    plain = reference(**AR)
    assert [o.token_ids for o in plain] != [o.token_ids for o in ref]
    assert sum(o.forwards for o in got) < sum(o.forwards for o in ref)


def test_refused_where_it_cannot_run(llm, prompts, family_dirs):
    eng = llm.engine
    for knobs, message in ((dict(edit_threshold=0.9), "cannot be combined with edit_threshold"),
                           (dict(multi_block_threshold=0.5), "multi_block_threshold needs a policy without a per-bl"),
                           (dict(small_block_size=4), "cannot be combined with small_block_size")):
        with pytest.raises(InvalidRequestError, match=message):
            eng.add_request(prompts[0], GenerationParams(policy="speculative", **knobs))
    other = LLM(family_dirs["sdar"], dtype="float32", device="cpu")
    with pytest.raises(InvalidRequestError, match="needs a block-causal model with a causal context"):
        other.engine.add_request([5, 6, 7], GenerationParams(policy="speculative"))


def test_over_http_the_same_text_and_a_400_for_what_it_cannot_do():
    from fastapi.testclient import TestClient

    from unmask.server.app import ServerArgs, create_app, load_serving

    args = ServerArgs(model=MODEL, served_model_name="m", dtype="float32")
    app = create_app(args)
    load_serving(app, args)
    http = TestClient(app)
    body = {"model": "m", "prompt": "def add(a, b):\n", "max_tokens": 16, "temperature": 0}
    ref = http.post("/v1/completions", json={**body, "block_size": 1, "policy": "topk", "tokens_per_step": 1})
    got = http.post("/v1/completions", json={**body, "policy": "speculative", "draft_all_outcomes": True})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    bad = http.post("/v1/completions", json={**body, "policy": "speculative", "small_block_size": 2})
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "policy" and "cannot be combined with small_block_size" in err["message"]


def test_snapshots_show_the_draft_block_masked_and_resolving(llm, prompts):
    seq = llm.engine.add_request(prompts[0], GenerationParams(max_tokens=20, policy="speculative", block_size=4,
                                                              snapshots=True))
    frames = []
    while seq.status != Status.FINISHED:
        llm.engine.step()
        frames.append(seq.snapshot())
    mask = llm.engine.traits.mask_id
    for f in frames[:-1]:
        n = len(f) - f.count(mask)
        assert f[:n] == seq.output_ids[:n] and 0 < f.count(mask) <= 4 and set(f[n:]) == {mask}
    assert frames[-1] == seq.output_ids and len(seq.output_ids) == 20
