"""The step engine against a naive full-recompute loop, batching invariance, stopping, bad input."""
import dataclasses
import math

import pytest
import torch

from naive_decode import naive_generate
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.errors import ContextLengthError, InvalidRequestError
from unmask.models.loader import load_model

BLOCK_CAUSAL = ["sdar", "fast_dllm_v2", "llada2", "unmask_shifted", "unmask_causal_context"]
ALL = ["llada", "dream"] + BLOCK_CAUSAL


def make_unmask_shifted(out, causal_context: bool = False):
    """unmask's own format as `unmask train --objective causal` exports it: shifted logits, so each block's
    first token comes from the previous block's commit pass (what `unmask-tiny` is since it is AR-initialised).
    `causal_context`: as `unmask train --causal-context` exports it (committed text attends token-causally)."""
    from unmask.train.checkpoint import export_model
    from unmask.train.model_init import fresh_model, init_weights, new_unmask_config

    cfg = new_unmask_config(96, 32, 2, 4, 2, 8, 64, 256, 4, mask_id=3, eos_ids=[2], tie_embeddings=True)
    cfg["shift_logits"] = True
    if causal_context:
        cfg["causal_context"] = True
    tm = fresh_model(cfg, {"eos_token_id": [2]}, seed=0)
    init_weights(tm.model, 0, std=0.2)  # logits far from uniform, so a wrong row shows
    return export_model(tm, out, None)


@pytest.fixture(scope="module")
def models(family_dirs, tmp_path_factory):
    dirs = {**family_dirs, "unmask_shifted": make_unmask_shifted(tmp_path_factory.mktemp("unmask") / "m"),
            "unmask_causal_context": make_unmask_shifted(tmp_path_factory.mktemp("unmask") / "c", causal_context=True)}
    return {f: load_model(dirs[f]) for f in ALL}


def run(model, spec, prompts, params):
    eng = Engine(model, spec, max_num_seqs=16)
    seqs = [eng.add_request(p, params) for p in prompts]
    eng.run_to_completion()
    return seqs, eng


PROMPTS = [list(range(20, 33)), list(range(40, 45)), list(range(50, 58))]  # 13, 5, 8 tokens: mid-block, short, aligned


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("policy", ["threshold", "low_confidence"])
def test_engine_matches_naive_loop(family, policy, models):
    model, spec = models[family]
    params = GenerationParams(max_tokens=13, policy=policy, threshold=0.3, steps=2, block_size=4, seed=0)
    seqs, _ = run(model, spec, PROMPTS, params)
    for p, s in zip(PROMPTS, seqs):
        assert s.output_ids == naive_generate(model, spec, p, params), (family, p)


@pytest.mark.parametrize("family", ["unmask_shifted", "unmask_causal_context"])
def test_shifted_unmask_with_one_token_blocks_is_greedy_autoregressive(family, models):
    """With one-token blocks every token is a block's first, read from the previous commit pass: plain
    next-token greedy decoding with a KV cache, compared against a full causal recompute per token."""
    from unmask.models.transformer import CAUSAL

    model, spec = models[family]
    params = GenerationParams(max_tokens=12, policy="topk", tokens_per_step=1, block_size=1)
    seqs, eng = run(model, spec, PROMPTS, params)
    for p, s in zip(PROMPTS, seqs):
        ids = list(p)
        for _ in range(params.max_tokens):
            with torch.no_grad():
                pos = torch.arange(len(ids))[None]
                lg = model.logits(model.forward_dense(torch.tensor([ids]), pos, CAUSAL))[0, -1]
            lg[spec.mask_id] = float("-inf")
            ids.append(int(lg.argmax()))
            if ids[-1] in spec.stop_ids:
                ids.pop()
                break
        assert s.output_ids == ids[len(p):], p
        assert len(s.output_ids) >= 3  # the comparison covers several tokens


@pytest.mark.parametrize("family", ALL)
def test_batched_equals_alone(family, models):
    model, spec = models[family]
    params = GenerationParams(max_tokens=12, policy="threshold", threshold=0.5, block_size=4)
    batched, _ = run(model, spec, PROMPTS, params)
    for p, s in zip(PROMPTS, batched):
        alone, _ = run(model, spec, [p], params)
        assert s.output_ids == alone[0].output_ids


def test_block_causal_cache_is_exact_and_fused(models):
    model, spec = models["sdar"]
    params = GenerationParams(max_tokens=16, policy="topk", tokens_per_step=1, block_size=4)
    seqs, eng = run(model, spec, [PROMPTS[0]], params)
    s = seqs[0]
    assert s.output_ids == naive_generate(model, spec, PROMPTS[0], params)
    # one token per forward: 16 tokens in 16 forwards (finished blocks' K/V ride along, no extra pass)
    assert len(s.output_ids) == 16 and s.stats.forwards == 16
    assert eng.stats.steps == 16


def test_chunked_prefill_matches_single_pass(models):
    model, spec = models["sdar"]
    prompt = list(range(30, 30 + 70))
    params = GenerationParams(max_tokens=8, policy="threshold", threshold=0.5, block_size=4)
    eng_small = Engine(model, spec, max_batch_tokens=16)  # forces 16-token prefill chunks
    a = eng_small.add_request(prompt, params)
    eng_small.run_to_completion()
    b, _ = run(model, spec, [prompt], params)
    assert a.stats.forwards > b[0].stats.forwards
    assert a.output_ids == b[0].output_ids == naive_generate(model, spec, prompt, params)


@pytest.mark.parametrize("family", BLOCK_CAUSAL)
def test_split_long_prefix_attention_gives_the_same_generation(family, models, monkeypatch):
    """Every masked segment after a cached prefix takes the split attention path (prefix unmasked, own keys
    masked, merged by log-sum-exp), or, for a causal-context model's prompt chunks, the unmasked causal path:
    chunked prefill and decoding give the tokens of the naive dense loop."""
    from unmask.models import attention

    if attention._CPU_FLASH is None:
        pytest.skip("torch without the CPU flash-attention op")
    model, spec = models[family]
    prompt = [30 + (7 * i) % 50 for i in range(45)]
    params = GenerationParams(max_tokens=12, policy="threshold", threshold=0.5, block_size=4)
    calls = []
    path = "_attend_causal" if spec.causal_context else "_attend_split"
    real = getattr(attention, path)
    monkeypatch.setattr(attention, path, lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(attention, "SPLIT_MIN_ELEMENTS", 0)
    eng = Engine(model, spec, max_batch_tokens=16)  # 16-token prefill chunks after the first
    seq = eng.add_request(prompt, params)
    eng.run_to_completion()
    assert len(calls) >= 3  # the path ran, for every prefill chunk
    assert seq.output_ids == naive_generate(model, spec, prompt, params)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_bidirectional_caches_run_and_first_step_is_exact(family, cache, models):
    model, spec = models[family]
    exact = GenerationParams(max_tokens=8, policy="topk", tokens_per_step=4, block_size=4, cache="none")
    approx = GenerationParams(max_tokens=8, policy="topk", tokens_per_step=4, block_size=4, cache=cache)
    a, _ = run(model, spec, [PROMPTS[0]], exact)
    b, _ = run(model, spec, [PROMPTS[0]], approx)
    assert len(b[0].output_ids) == 8 and b[0].finish_reason == "length"
    # each block's first step is a full refresh, so the first 4 tokens (one step) agree exactly
    assert a[0].output_ids[:4] == b[0].output_ids[:4]


def test_stop_token_finishes_early(models):
    """A stop token ends the output. Here it is committed at output index 5 while index 4 is still masked, so
    index 6 and on are no longer decoded: index 4 is then read with a mask after the stop token, not the token the
    free run put there, and comes out as the stop token itself (the reference loop follows the same rule)."""
    model, spec = models["sdar"]
    params = GenerationParams(max_tokens=12, policy="threshold", threshold=0.5, block_size=4)
    free, _ = run(model, spec, [PROMPTS[0]], params)
    tokens = free[0].output_ids
    stop_tok = tokens[5]
    assert tokens.index(stop_tok) == 5
    params2 = GenerationParams(max_tokens=12, policy="threshold", threshold=0.5, block_size=4, stop_token_ids=[stop_tok])
    s, _ = run(model, spec, [PROMPTS[0]], params2)
    assert s[0].finish_reason == "stop"
    assert s[0].output_ids == tokens[:4] == naive_generate(model, spec, PROMPTS[0], params2)


def test_seed_reproducible_and_temperature_varies(models):
    model, spec = models["sdar"]
    p = lambda seed: GenerationParams(max_tokens=12, temperature=1.0, seed=seed, block_size=4)  # noqa: E731
    a, _ = run(model, spec, [PROMPTS[1]], p(7))
    b, _ = run(model, spec, [PROMPTS[1]], p(7))
    c, _ = run(model, spec, [PROMPTS[1]], p(8))
    assert a[0].output_ids == b[0].output_ids
    assert a[0].output_ids != c[0].output_ids


def test_logprobs_are_probabilities(models):
    model, spec = models["sdar"]
    eng = Engine(model, spec)
    eng.add_request(PROMPTS[0], GenerationParams(max_tokens=8, block_size=4, logprobs=True))
    lps = []
    while eng.has_unfinished():
        for out in eng.step():
            lps += out.new_logprobs or []
    assert len(lps) == 8 and all(lp <= 0.0 for lp in lps)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_top_logprobs_are_the_drawing_distribution(models, temperature):
    """The k most likely tokens of the distribution each token was drawn from; greedy: the token is first."""
    model, spec = models["sdar"]
    eng = Engine(model, spec)
    seq = eng.add_request(PROMPTS[0], GenerationParams(max_tokens=8, block_size=4, logprobs=True, top_logprobs=4,
                                                        temperature=temperature, seed=3))
    lps, tops = [], []
    while eng.has_unfinished():
        for out in eng.step():
            lps += out.new_logprobs or []
            tops += out.new_top_logprobs or []
    assert len(tops) == 8 and all(len(t) == 4 for t in tops)
    for tok, lp, top in zip(seq.output_ids, lps, tops):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-5
        if temperature == 0.0:
            assert top[0][0] == tok and top[0][1] == pytest.approx(lp, abs=1e-5)
        elif tok in dict(top):  # the drawn token's own logprob comes from the same distribution
            assert dict(top)[tok] == pytest.approx(lp, abs=1e-5)
    with pytest.raises(InvalidRequestError, match="top_logprobs requires logprobs"):
        GenerationParams(top_logprobs=2)


def test_abort_frees_slot(models):
    model, spec = models["sdar"]
    eng = Engine(model, spec, max_num_seqs=1)
    a = eng.add_request(PROMPTS[0], GenerationParams(max_tokens=64, block_size=4))
    b = eng.add_request(PROMPTS[1], GenerationParams(max_tokens=4, block_size=4))
    eng.step()
    assert eng.num_running == 1 and eng.num_waiting == 1
    out = eng.abort(a.request_id)
    assert out.finished and out.finish_reason == "abort"
    eng.run_to_completion()
    assert b.finish_reason == "length" and len(b.output_ids) == 4


def test_bad_requests(models):
    model, spec = models["sdar"]
    eng = Engine(model, spec)
    with pytest.raises(ContextLengthError, match="over this model's context"):
        eng.add_request([5] * 10, GenerationParams(max_tokens=spec.max_context))
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        eng.add_request([], GenerationParams())
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        eng.add_request([10**9], GenerationParams())
    with pytest.raises(InvalidRequestError, match="max_tokens must be a positive integer"):
        GenerationParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="policy"):
        GenerationParams(policy="nope")
    with pytest.raises(InvalidRequestError, match="at most 4 stop"):
        GenerationParams(stop=["a", "b", "c", "d", "e"])


def test_prefix_cache_reuses_prompt_blocks_exactly(models):
    model, spec = models["sdar"]
    system = list(range(60, 60 + 24))  # six whole blocks of 4 shared by both prompts
    params = GenerationParams(max_tokens=8, policy="threshold", threshold=0.5, block_size=4)
    eng = Engine(model, spec)
    a = eng.add_request(system + [7, 8, 9], params)
    eng.run_to_completion()
    assert a.stats.prefill_tokens == 27 and eng.prefix_cache.hits == 0
    b = eng.add_request(system + [10, 11], params)
    assert b.cached == 24 and eng.prefix_cache.hits == 6  # restored, not recomputed
    eng.run_to_completion()
    assert b.stats.prefill_tokens == 2  # only the prompt tail inside the first answer block
    fresh, _ = run(model, spec, [system + [10, 11]], GenerationParams(**{**params.__dict__}))
    assert b.output_ids == fresh[0].output_ids
    # a different block size must not hit blocks computed under another mask
    c = eng.add_request(system + [10, 11], GenerationParams(max_tokens=4, block_size=8))
    assert c.cached == 0


@pytest.mark.parametrize("family", ["fast_dllm_v2", "unmask_shifted", "unmask_causal_context"])
def test_shifted_families_restore_all_but_the_block_before_the_answer(family, models):
    """A block-aligned prompt whose blocks are all cached: a shifted family still needs the last prompt
    block's final row for the answer's first token, so that block runs again (it used to hang)."""
    model, spec = models[family]
    prompt = list(range(60, 60 + 24))  # six whole blocks of 4: the answer starts on a block boundary
    params = GenerationParams(max_tokens=8, policy="threshold", threshold=0.5, block_size=4)
    eng = Engine(model, spec)
    a = eng.add_request(prompt, params)
    eng.run_to_completion()
    b = eng.add_request(prompt, params)
    assert b.cached == 20 and eng.prefix_cache.hits == 5
    eng.run_to_completion()
    assert b.finish_reason is not None and b.output_ids == a.output_ids
    assert b.output_ids == naive_generate(model, spec, prompt, params)
    # a caller that fills the whole prompt itself (as a benchmark shortcut might) gets an error, not a hang
    d = Engine(model, spec).add_request(prompt, params)
    d.cached = d.block_start
    with pytest.raises(RuntimeError, match="block before the answer"):
        d.plan(4096)
    # chunked prefill under a tiny token budget stops one block short as well
    small = Engine(model, spec, max_batch_tokens=4)
    c = small.add_request(prompt, params)
    small.run_to_completion()
    assert c.output_ids == a.output_ids


@pytest.mark.parametrize("stops", [["a", "b"], ["b", "a"], ["yyb", "a"]])
def test_the_earliest_stop_string_ends_the_text(stops):
    from unmask.defaults import default_model_path
    from unmask.engine.detokenizer import TextStream
    from unmask.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    ids = tok.encode("xxa yyb zz")
    stream = TextStream(tok, stops)
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == "xx"
    included = TextStream(tok, stops, include_stop=True)
    assert included.push(ids) + included.flush() == "xxa"


def test_a_stop_string_ends_the_token_ids_and_logprobs_too():
    """A step can commit a whole block: the tokens after the one that completes a stop string are dropped from
    token_ids, logprobs and the count, not only from the text."""
    from unmask.engine.llm import LLM

    llm = LLM()   # the built-in model: a real tokenizer, so every token writes text
    whole = GenerationParams(max_tokens=16, policy="topk", tokens_per_step=8, block_size=8, ignore_eos=True,
                             logprobs=True)
    prompt = "def add(a, b):\n    return"
    ref = llm.generate(prompt, whole)[0]
    pieces = [llm.tokenizer.decode(ref.token_ids[:k]) for k in range(len(ref.token_ids) + 1)]
    k = next(k for k in range(3, 7) if len(pieces[k]) > len(pieces[k - 1]) >= 1)  # token k-1 adds text
    stop = pieces[k][len(pieces[k - 1]) - 1:]   # the last character before token k-1 and all of that token's text
    cut = llm.generate(prompt, dataclasses.replace(whole, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and cut.text == pieces[k][:pieces[k].find(stop)]
    assert cut.token_ids == ref.token_ids[:len(cut.token_ids)] and len(cut.token_ids) <= k < len(ref.token_ids)
    assert stop in llm.tokenizer.decode(cut.token_ids)                   # through the token that completes it
    assert stop not in llm.tokenizer.decode(cut.token_ids[:-1])
    assert len(cut.logprobs) == len(cut.token_ids)


def test_a_refused_prompt_leaves_no_earlier_request_behind(family_dirs):
    from unmask.engine.llm import LLM

    llm = LLM(family_dirs["sdar"])
    with pytest.raises(InvalidRequestError, match="prompt token ids must be in"):
        llm.generate([[20, 21, 22], [10**7]], GenerationParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    assert GenerationParams(stop="(a").stop == ["(a"]   # a single stop string, not its characters
    p = GenerationParams(max_tokens=3)
    assert llm.generate((20, 21, 22), p)[0].token_ids == llm.generate([20, 21, 22], p)[0].token_ids   # ids as a tuple
    with pytest.raises(InvalidRequestError, match="a prompt is a string or a list of token ids, got float"):
        llm.generate([1.5], p)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", "0.5", "temperature must be a number, got '0.5'"),
    ("top_k", 1.5, "top_k must be an integer, got 1.5"),
    ("max_tokens", True, "max_tokens must be a positive integer, got True"),
])
def test_wrong_types_are_request_errors(field, value, message):
    with pytest.raises(InvalidRequestError) as e:
        GenerationParams(**{field: value})
    assert str(e.value) == message and e.value.param == field


def test_generate_progress_counts_finished_requests(family_dirs, monkeypatch):
    from unmask.engine import llm as llm_module

    bars = []
    real = llm_module._progress_bar
    monkeypatch.setattr(llm_module, "_progress_bar", lambda total: bars.append(real(total)) or bars[-1])
    llm = llm_module.LLM(family_dirs["sdar"])
    outs = llm.generate([[20, 21, 22], [30, 31]], GenerationParams(max_tokens=4), progress=True)
    assert len(outs) == 2 and len(bars) == 1
    task = bars[0].tasks[0]
    assert (task.total, task.completed) == (2, 2) and not bars[0].live.is_started


def test_min_tokens_holds_stop_strings_and_stop_tokens(models):
    from unmask.defaults import default_model_path
    from unmask.engine.detokenizer import TextStream
    from unmask.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    ids = tok.encode("\n    x = 1\n    y = 2\n")
    first = tok.decode(ids[:1])
    assert first.startswith("\n")
    plain, held = TextStream(tok, ["\n"]), TextStream(tok, ["\n"], min_tokens=1)
    assert plain.push(ids) + plain.flush() == ""
    assert held.push(ids) + held.flush() == "\n    x = 1"   # the stop applies after the first token
    model, spec = models["sdar"]
    eng = Engine(model, spec)
    stops = list(spec.stop_ids)
    # every stop token pushed to the top: without min_tokens the first output token ends the request
    bias = {t: 100.0 for t in stops}
    out = [eng.add_request(PROMPTS[0], GenerationParams(max_tokens=8, block_size=4, logit_bias=bias, min_tokens=m))
           for m in (0, 5)]
    eng.run_to_completion()
    assert len(out[0].output_ids) == 0 and out[0].finish_reason == "stop"
    assert len(out[1].output_ids) == 5 and out[1].finish_reason == "stop"
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        GenerationParams(max_tokens=4, min_tokens=5)


def test_causal_context_writes_the_prompt_as_a_causal_model_does(models):
    """The prompt's cached K/V under a causal context are a left-to-right model's (prompt rows never see
    later prompt tokens of their block), and differ from the block-causal model's on the same weights."""
    from unmask.models.transformer import CAUSAL

    model, spec = models["unmask_causal_context"]
    assert spec.causal_context and not models["unmask_shifted"][1].causal_context
    prompt = list(range(20, 32))  # three whole blocks: the answer's first token is read from causal row 11
    eng = Engine(model, spec, prefix_cache_bytes=0)
    seq = eng.add_request(prompt, GenerationParams(max_tokens=4, block_size=4))
    eng.step()  # the first pass writes the whole prompt, [0, 12), and reads the answer block
    assert seq.cached == 12
    k0 = seq.cache.k[0][:, :12].clone()
    with torch.no_grad():  # layer-0 keys of a causal pass: recompute them from the dense causal forward
        h = model.model.embed_tokens(torch.tensor([prompt[:12]]))
        attn = model.model.layers[0].self_attn
        x = model.model.layers[0].input_layernorm(h)
        k = attn.k_norm(attn.k_proj(x).view(1, 12, attn.kv, attn.d))
        cos, sin = model.rope.cos_sin(torch.arange(12)[None])
        k = model.rope.apply(k, cos, sin)[0].transpose(0, 1)
    assert torch.allclose(k0, k, atol=1e-5)  # layer 0 keys depend on the token alone
    k_last = seq.cache.k[-1][:, :12].clone()
    with torch.no_grad():
        hd = model.forward_dense(torch.tensor([prompt[:12]]), torch.arange(12)[None], CAUSAL)
        logits = model.logits(hd)[0, 11]
    # the causal row 11 predicts the answer's first token: the engine's first committed token is its argmax
    eng.run_to_completion()
    logits[spec.mask_id] = float("-inf")
    assert seq.output_ids[0] == int(logits.argmax())
    block_causal = Engine(models["unmask_shifted"][0], models["unmask_shifted"][1], prefix_cache_bytes=0)
    other = block_causal.add_request(prompt, GenerationParams(max_tokens=4, block_size=4))
    block_causal.step()
    assert not torch.allclose(other.cache.k[-1][:, :12], k_last, atol=1e-4)


def test_credit_policy_knobs_reach_the_policy(models):
    """credit_weight 0 fuses nothing, so the credit policy decodes exactly as the threshold policy; a large
    weight lets the fused top-1 proposals cross the threshold sooner (fewer forwards for the same 16 tokens)."""
    model, spec = models["sdar"]
    p = lambda **kw: GenerationParams(max_tokens=16, threshold=0.5, block_size=8, ignore_eos=True, **kw)  # noqa: E731
    plain, eng_plain = run(model, spec, PROMPTS, p(policy="threshold"))
    zero, eng_zero = run(model, spec, PROMPTS, p(policy="credit", credit_weight=0.0))
    assert [s.output_ids for s in zero] == [s.output_ids for s in plain]
    assert eng_zero.stats.tokens_fed == eng_plain.stats.tokens_fed
    # a random model's top-1 p is ~1/V: gamma 0.05 and weight 1000 make its credit decisive
    alone, eng_alone = run(model, spec, PROMPTS[:1], p(policy="threshold"))
    heavy, eng_heavy = run(model, spec, PROMPTS[:1], p(policy="credit", credit_weight=1000.0, credit_gamma=0.05))
    assert len(heavy[0].output_ids) == 16
    assert eng_heavy.stats.steps < eng_alone.stats.steps / 2


def test_alg_temp_samples_the_commit_order_per_seed(models):
    """Dream's alg_temp: 0 commits the most confident rows whatever the seed; > 0 draws them, reproducibly."""
    model, spec = models["sdar"]
    p = lambda t, seed: GenerationParams(max_tokens=8, policy="maskgit_plus", steps=2, block_size=8,  # noqa: E731
                                         ignore_eos=True, alg_temp=t, seed=seed)
    out = lambda t, seed: run(model, spec, [PROMPTS[0]], p(t, seed))[0][0].output_ids  # noqa: E731
    greedy = out(0.0, 1)
    assert out(0.0, 2) == greedy
    sampled = {seed: out(5.0, seed) for seed in range(4)}
    assert out(5.0, 3) == sampled[3]
    assert any(ids != greedy for ids in sampled.values())


@pytest.mark.parametrize("field, value", [("alg_temp", -1.0), ("credit_decay", 1.5), ("credit_gamma", 0.0),
                                          ("credit_weight", -0.1)])
def test_policy_knob_errors_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        GenerationParams(policy="credit", **{field: value})
    assert e.value.param == field and str(e.value).startswith(f"{field} must be")


def test_forward_timer_reads_device_events_without_waiting(monkeypatch):
    """On CUDA the runner times forwards with events it reads once they have completed (no sync per step);
    `settle` waits for the rest. Driven here by a stand-in Event whose completion the test decides."""
    from unmask.engine import runner as R

    done: set[int] = set()

    class FakeEvent:
        count = 0

        def __init__(self, enable_timing: bool):
            FakeEvent.count += 1
            self.i, self.t = FakeEvent.count, None

        def record(self):
            self.t = 0.010 * self.i  # events 10 ms apart

        def query(self):
            return self.i in done

        def synchronize(self):
            done.add(self.i)

        def elapsed_time(self, end):
            return (end.t - self.t) * 1000

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = R.ForwardTimer(torch.device("cuda"))
    timer.start()
    assert timer.stop() == 0.0 and len(timer.pending) == 1  # still running: nothing reported, nothing awaited
    done.update({1, 2})
    timer.start()
    assert timer.stop() == pytest.approx(0.010)  # the first forward finished meanwhile
    assert timer.settle() == pytest.approx(0.010) and not timer.pending  # the second, waited for


def test_cuda_graphs_are_on_only_for_declaring_models_on_cuda(monkeypatch):
    from unmask.engine.graphs import graphs_enabled

    class Declares(torch.nn.Module):
        graph_decode_steps = True

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("UNMASK_CUDA_GRAPHS", raising=False)
    assert graphs_enabled(Declares(), cuda) and not graphs_enabled(Declares(), cpu)
    assert not graphs_enabled(torch.nn.Linear(1, 1), cuda)  # a model that does not declare graph-safe steps
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("UNMASK_CUDA_GRAPHS", off)
        assert not graphs_enabled(Declares(), cuda)
