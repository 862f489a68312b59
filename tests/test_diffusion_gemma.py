"""DiffusionGemma: unmask's native text path against transformers' reference implementation.

Tiny random checkpoints are built with transformers' own `DiffusionGemmaConfig` and
`DiffusionGemmaForBlockDiffusion` and written with `save_pretrained` (families.md 6.6); norms, layer
scalars (encoder and decoder ones differ) and router scales are randomised so that every weight is
exercised, and the tied embedding is scaled up so that the logits are peaked: canvases accept several
tokens per step and stop early, as a trained model does.

Identity protocol: `torch.manual_seed(s)` before the reference's `generate` and `seed=s` in unmask draw the
same random numbers in the same order (uniform canvas, multinomial, re-noise), so outputs must be equal
token for token.
"""
from __future__ import annotations

import asyncio
import json
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.diffusion_gemma import DiffusionGemmaTextConfig  # noqa: E402
from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen_ref  # noqa: E402

from unmask.decoding import uniform as U  # noqa: E402
from unmask.engine.engine import Engine  # noqa: E402
from unmask.engine.gemma_sequence import GemmaSequence  # noqa: E402
from unmask.engine.params import GenerationParams  # noqa: E402
from unmask.errors import InvalidRequestError, UnsupportedModelError  # noqa: E402
from unmask.models.attention import AttentionBatch, Segment  # noqa: E402
from unmask.models.loader import load_model  # noqa: E402

VOCAB = 512
IMAGE_ID = 500  # image_token_id inside the tiny vocabulary, so that a prompt can hold it
CHAT_TEMPLATE = (  # Gemma-style turns; a fixture, not a claim about the released template
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# ---------------------------------------------------------------------------------------- fixtures

def write_tokenizer(out: Path) -> None:
    """Byte-level BPE: <pad> 0, <eos> 1, <bos> 2, bytes 3..258, turn markers 259/260 (all ids < VOCAB)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<pad>", "<eos>", "<bos>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    turns = ["<start_of_turn>", "<end_of_turn>"]
    for t in turns:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials + turns])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))


def tiny_config(canvas_length: int = 8, **text_overrides) -> DiffusionGemmaConfig:
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, top_k_experts=2,
                moe_intermediate_size=32, sliding_window=16,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                global_head_dim=32, num_global_key_value_heads=1)
    text.update(text_overrides)
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, position_embedding_size=64,
                  patch_size=16)
    return DiffusionGemmaConfig(text_config=DiffusionGemmaTextConfig(**text), vision_config=vision,
                                canvas_length=canvas_length, image_token_id=IMAGE_ID)


def make_checkpoint(out: Path, seed: int = 0, embed_std: float = 1.0, **kw) -> Path:
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(tiny_config(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        dec = model.model.decoder
        dec.embed_tokens.weight.normal_(0, embed_std, generator=g)  # peaked logits (tied LM head)
        for name, p in dec.named_parameters():
            if name.endswith("norm.weight") or name.endswith("router.scale"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("per_expert_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0, 0.15, generator=g)
        enc_layers = model.model.encoder.language_model.layers
        for i, layer in enumerate(dec.layers):
            layer.layer_scalar.fill_(0.8 + 0.1 * i)
            enc_layers[i].layer_scalar.fill_(1.1 - 0.1 * i)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("dgemma"))


@pytest.fixture(scope="module")
def ref(ckpt):
    return DiffusionGemmaForBlockDiffusion.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def native(ckpt):
    return load_model(ckpt, dtype="float32")


@pytest.fixture(scope="module")
def logits_pair(tmp_path_factory):
    """A less peaked checkpoint for the logit comparison: with embed_std 1.0 (logits up to ~24) the reference's
    own eager and SDPA attention already differ by ~7.5e-5 in float32 (measured), too close to 1e-4; at 0.3
    that floor is ~2e-5 and unmask stays at it."""
    d = make_checkpoint(tmp_path_factory.mktemp("dgemma_logits"), seed=1, embed_std=0.3)
    return DiffusionGemmaForBlockDiffusion.from_pretrained(d).eval(), load_model(d, dtype="float32")


def ref_generate(ref, prompt: list[int], seed: int, canvas: int, **kw) -> list[int]:
    ref.config.canvas_length = canvas  # generate reads the canvas length from the config
    torch.manual_seed(seed)
    out = ref.generate(torch.tensor([prompt]), **kw)
    return out.sequences[0, len(prompt):].tolist()


def cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[:tokens.index(eos)] if eos is not None and eos in tokens else tokens


# ---------------------------------------------------------------------------------------- pure policies

def test_linear_temperature_matches_reference_processor():
    proc = gen_ref.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=7)
    x = torch.randn(2, 3, 11)
    for remaining in range(7, 0, -1):
        want = proc(None, x, cur_step=torch.tensor(remaining, dtype=torch.int32))
        assert torch.equal(x / U.linear_temperature(remaining, 7, 0.4, 0.8), want)
    assert U.linear_temperature(7, 7, 0.4, 0.8).item() == pytest.approx(0.8)
    assert U.linear_temperature(1, 4, 0.4, 0.8).item() == pytest.approx(0.5)


def test_categorical_entropy_hand_made_and_reference():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e30, -1e30, -1e30], [1.0, 2.0, 3.0, -float("inf")]])
    h = U.categorical_entropy(logits)
    assert h[0].item() == pytest.approx(math.log(4))
    assert h[1].item() == pytest.approx(0.0, abs=1e-6)
    x = torch.randn(3, 5, 17) * 4
    assert torch.equal(U.categorical_entropy(x), torch.distributions.Categorical(logits=x).entropy())


def test_entropy_bound_mask_hand_made():
    h = torch.tensor([[0.5, 0.01, 0.02, 0.3]])
    # sorted 0.01, 0.02, 0.3, 0.5: sum before each = 0, 0.01, 0.03, 0.33
    assert U.entropy_bound_mask(h, 0.1).tolist() == [[False, True, True, True]]
    assert U.entropy_bound_mask(h, 0.02).tolist() == [[False, True, True, False]]
    assert U.entropy_bound_mask(h, 1e-9).tolist() == [[False, True, False, False]]  # the lowest always passes
    assert U.entropy_bound_mask(h, 10.0).all()


def test_renoise_keeps_accepted_and_draws_the_rest():
    canvas = torch.tensor([[7, 8, 9, 10]])
    keep = torch.tensor([[True, False, True, False]])
    out = U.renoise(canvas, keep, 50, torch.Generator().manual_seed(3))
    noise = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(3))
    assert out[0, 0] == 7 and out[0, 2] == 9
    assert out[0, 1] == noise[0, 1] and out[0, 3] == noise[0, 3]


def test_lean_draws_sample_the_distribution_and_noise_the_rest():
    v, c = 6, 4000
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    probs = p.expand(1, c, v)
    accepted = torch.ones(1, c, dtype=torch.bool)
    accepted[0, ::2] = False                     # every other position is re-noised
    out = U.lean_next(probs, accepted, v, [torch.Generator().manual_seed(0)])
    kept = out[0, 1::2]
    freq = torch.bincount(kept, minlength=v).float() / kept.numel()
    assert (freq - p).abs().max() < 0.03 and freq[3:].sum() == 0  # zero-probability tokens never drawn
    noise = out[0, ::2]
    assert noise.min() >= 0 and noise.max() < v and (torch.bincount(noise, minlength=v) > 250).all()
    # each row draws c uniforms then c noise ids from its own generator
    g = torch.Generator().manual_seed(0)
    u, ids = torch.rand(c, generator=g), torch.randint(0, v, (c,), generator=g)
    assert torch.equal(noise, ids[::2])
    assert torch.equal(kept, torch.searchsorted(p.cumsum(0), u[1::2] * p.sum(), right=True))


def test_lean_batch_equals_each_row_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 8, 20) * 3
    canvas = torch.randint(0, 20, (3, 8))
    cfgs = [U.UniformConfig(max_steps=8, draws="lean", entropy_bound=b) for b in (0.1, 1.0, 5.0)]
    batch = U.denoise_batch(logits, canvas, [8, 5, 2], cfgs, [None] * 3,
                            [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    for i in range(3):
        alone = U.denoise_step(logits[i:i + 1], canvas[i:i + 1], [8, 5, 2][i], cfgs[i], None,
                               torch.Generator().manual_seed(i + 1))
        assert torch.equal(batch[i].canvas, alone.canvas) and torch.equal(batch[i].accepted, alone.accepted)


def test_stable_and_confident_hand_made():
    low = torch.zeros(1, 3)
    d1, d2 = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])
    stop, hist = U.stable_and_confident(None, d1, low, 2, 0.1)
    assert not stop.item()                      # no history yet
    stop, hist = U.stable_and_confident(hist, d1, low, 2, 0.1)
    assert not stop.item()                      # one previous draft only
    stop, hist = U.stable_and_confident(hist, d1, low, 2, 0.1)
    assert stop.item()                          # two identical previous drafts, confident
    stop, _ = U.stable_and_confident(hist, d2, low, 2, 0.1)
    assert not stop.item()                      # draft changed
    stop, _ = U.stable_and_confident(None, d1, low + 1.0, 0, 0.1)
    assert not stop.item()                      # threshold 0: always stable, but not confident
    stop, _ = U.stable_and_confident(None, d1, low, 0, 0.1)
    assert stop.item()


def test_uniform_config_validation():
    for bad in (dict(max_steps=0), dict(entropy_bound=0.0), dict(t_min=0.5, t_max=0.5), dict(t_min=-1.0),
                dict(stability_threshold=-1), dict(confidence_threshold=0.0)):
        with pytest.raises(ValueError):
            U.UniformConfig(**bad)


def test_denoise_step_is_the_reference_step():
    """One step, built from the reference's own sampler / processor / stopping classes with the global RNG."""
    b, c, v, n = 1, 6, 40, 5
    logits = torch.randn(b, c, v) * 6
    canvas = torch.randint(0, v, (b, c))
    sampler = gen_ref.EntropyBoundSampler(gen_ref.EntropyBoundSamplerConfig(entropy_bound=0.3), c, v, n)
    proc = gen_ref.LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, n)
    stopper = gen_ref.StableAndConfidentStoppingCriteria(1, 0.5)
    cfg = U.UniformConfig(max_steps=n, entropy_bound=0.3, stability_threshold=1, confidence_threshold=0.5)
    gen, noise = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    torch.manual_seed(11)
    hist = None
    for remaining in range(n, 0, -1):
        processed = proc(None, logits, cur_step=torch.tensor(remaining, dtype=torch.int32))
        probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
        sampled = torch.multinomial(probs.view(-1, v), 1).view(b, c)
        accepted = sampler.accept_canvas(canvas, sampled, processed, remaining)
        ref_next = sampler.renoise_canvas(accepted, remaining)
        ref_stop = stopper(processed.argmax(-1), processed)
        mine = U.denoise_step(logits, canvas, remaining, cfg, hist, gen)
        assert torch.equal(mine.canvas, ref_next)
        assert torch.equal(mine.draft, processed.argmax(-1))
        assert torch.equal(mine.processed, processed)
        assert torch.equal(mine.stop, ref_stop)
        canvas, hist = ref_next, mine.history
        logits = logits + torch.randn(b, c, v, generator=noise) * 0.01  # not from the global RNG


@pytest.mark.parametrize("mixed", [True, False])  # rows with different stability thresholds, or all alike
def test_denoise_batch_rows_equal_single_steps(mixed):
    c, v = 5, 30
    cfgs = [U.UniformConfig(max_steps=6), U.UniformConfig(max_steps=4, entropy_bound=0.5, t_min=0.2, t_max=1.0,
                                                          stability_threshold=2, confidence_threshold=0.9),
            U.UniformConfig(max_steps=6, stability_threshold=0)]
    logits = torch.randn(3, c, v) * 5
    canvas = torch.randint(0, v, (3, c))
    hist = [None, torch.randint(0, v, (2, 1, c)), None]
    if not mixed:
        cfgs = [U.UniformConfig(max_steps=6, confidence_threshold=2.0)] * 3
        hist = [None, torch.randint(0, v, (1, 1, c)), logits[2:3].argmax(-1)[None]]  # row 2: stable and confident
    batch = U.denoise_batch(logits, canvas, [6, 2, 3], cfgs, hist,
                            [torch.Generator().manual_seed(i) for i in range(3)])
    for i in range(3):
        one = U.denoise_step(logits[i:i + 1], canvas[i:i + 1], [6, 2, 3][i], cfgs[i], hist[i],
                             torch.Generator().manual_seed(i))
        for f in ("canvas", "draft", "processed", "entropy", "accepted", "stop"):
            assert torch.equal(getattr(batch[i], f), getattr(one, f)), (i, f)
        assert (batch[i].history is None) == (one.history is None)
        if one.history is not None:
            assert torch.equal(batch[i].history, one.history)


# ---------------------------------------------------------------------------------------- loading and logits

def test_loads_text_path_only(native, ckpt):
    model, spec = native
    assert spec.family.name == "diffusion_gemma"
    assert spec.block_size == 8  # canvas_length
    names = list(model.state_dict())
    assert not any("vision" in n or "embed_vision" in n for n in names)
    assert model.cfg.head_dims == (16, 16, 32) and model.cfg.kv_heads == (2, 2, 1)
    scal = [float(layer.encoder_layer_scalar) for layer in model.model.layers]
    assert scal == pytest.approx([1.1, 1.0, 0.9])  # the encoder's own buffers, not the decoder's


def _ref_decoder_logits(ref, prompt: torch.Tensor, canvas: torch.Tensor, sc=None):
    cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    p = prompt.shape[1]
    enc = ref.model.encoder(input_ids=prompt, cache=cache, position_ids=torch.arange(p)[None])
    out = ref(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc,
              decoder_position_ids=torch.arange(p, p + canvas.shape[1])[None])
    return enc.last_hidden_state, out.logits


@torch.no_grad()
@pytest.mark.parametrize("prompt_len", [5, 40])  # within, and well past, the sliding window (16)
def test_logits_match_reference(logits_pair, prompt_len):
    ref, (model, _) = logits_pair
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(3, VOCAB, (1, prompt_len), generator=g)
    canvas = torch.randint(0, VOCAB, (1, 8), generator=g)
    sc = torch.randn(1, 8, VOCAB, generator=g) * 3
    enc_h, dec_logits = _ref_decoder_logits(ref, prompt, canvas)
    _, sc_logits = _ref_decoder_logits(ref, prompt, canvas, sc)
    p, tol = prompt_len, 1e-4

    # encoder mode alone (causal, writes the cache); its hidden states through the head
    cache = model.new_cache(64)
    seg = Segment(start=0, length=p, write=p, cache=cache, extra={"encoder": p})
    h = model(prompt[0], torch.arange(p), AttentionBatch([seg]).prepare())
    ref_enc_logits = torch.tanh(ref.lm_head(enc_h[0]).float() / 30) * 30
    assert (model.logits(h) - ref_enc_logits).abs().max() <= tol
    cache.length = p
    # decoder mode: the canvas over the cached prompt, without and with self-conditioning
    for sc_in, want in ((None, dec_logits), (sc[0], sc_logits)):
        seg = Segment(start=p, length=8, write=0, cache=cache, extra={"encoder": 0, "sc_logits": sc_in})
        h = model(canvas[0], torch.arange(p, p + 8), AttentionBatch([seg]).prepare())
        assert (model.logits(h) - want[0]).abs().max() <= tol
    # both modes in one segment: [prompt (encoder) ; canvas (decoder)], plus a second request in the batch
    c1, c2 = model.new_cache(64), model.new_cache(64)
    s1 = Segment(start=0, length=p + 8, write=p, cache=c1, extra={"encoder": p, "sc_logits": None})
    s2 = Segment(start=0, length=p + 8, write=p, cache=c2, extra={"encoder": p, "sc_logits": None})
    ids = torch.cat([prompt[0], canvas[0]])
    h = model(torch.cat([ids, ids]), torch.arange(p + 8).repeat(2), AttentionBatch([s1, s2]).prepare())
    for rows in (slice(p, p + 8), slice(2 * p + 8, 2 * p + 16)):
        assert (model.logits(h[rows]) - dec_logits[0]).abs().max() <= tol


@pytest.fixture
def long_encoder_spy(monkeypatch):
    """Long-prompt encoder paths (no dense mask) from 8 encoder tokens on, recording which ran."""
    from unmask.models import diffusion_gemma as dg

    ran = []
    monkeypatch.setattr(dg, "LONG_ENCODER", 8)
    for name in ("attend_causal", "attend_banded", "attend_prefix_causal"):
        real = getattr(dg, name)
        monkeypatch.setattr(dg, name, lambda *a, _n=name, _f=real: ran.append(_n) or _f(*a))
    return ran


@torch.no_grad()
def test_long_encoder_paths_match_reference(logits_pair, long_encoder_spy):
    """Causal SDPA on full layers and windowed query chunks on sliding layers, for a prompt past the window
    (300 > 16): encoder logits, and both row kinds of a [prompt ; canvas] segment, equal the reference's."""
    ref, (model, _) = logits_pair
    g = torch.Generator().manual_seed(7)
    p = 300  # several 128-row query chunks on the sliding layers
    prompt = torch.randint(3, VOCAB, (1, p), generator=g)
    canvas = torch.randint(0, VOCAB, (1, 8), generator=g)
    enc_h, dec_logits = _ref_decoder_logits(ref, prompt, canvas)
    ref_enc_logits = torch.tanh(ref.lm_head(enc_h[0]).float() / 30) * 30
    seg = Segment(start=0, length=p, write=p, cache=model.new_cache(p + 8), extra={"encoder": p})
    h = model(prompt[0], torch.arange(p), AttentionBatch([seg]).prepare())
    assert (model.logits(h) - ref_enc_logits).abs().max() <= 1e-4
    assert set(long_encoder_spy) == {"attend_causal", "attend_banded"}
    long_encoder_spy.clear()
    seg = Segment(start=0, length=p + 8, write=p, cache=model.new_cache(p + 8), extra={"encoder": p, "sc_logits": None})
    h = model(torch.cat([prompt[0], canvas[0]]), torch.arange(p + 8), AttentionBatch([seg]).prepare())
    assert (model.logits(h[p:]) - dec_logits[0]).abs().max() <= 1e-4
    assert (model.logits(h[:p]) - ref_enc_logits).abs().max() <= 1e-4
    assert set(long_encoder_spy) == {"attend_causal", "attend_banded"}
    # the prompt in two chunks: the second chunk's full layer reads the cached first chunk whole
    long_encoder_spy.clear()
    cache, half = model.new_cache(p + 8), p // 2
    for lo, hi in ((0, half), (half, p)):
        seg = Segment(start=lo, length=hi - lo, write=hi - lo, cache=cache, extra={"encoder": hi - lo})
        h = model(prompt[0, lo:hi], torch.arange(lo, hi), AttentionBatch([seg]).prepare())
        cache.length = hi
    assert (model.logits(h) - ref_enc_logits[half:]).abs().max() <= 1e-4
    assert "attend_prefix_causal" in long_encoder_spy


# ---------------------------------------------------------------------------------------- generation

def _engine(native, **kw) -> Engine:
    model, spec = native
    return Engine(model, spec, **kw)


# the stop rule (stable and confident) rarely holds on a random model with the default thresholds; with
# stability 0 and a looser confidence bound canvases stop after different numbers of steps
EARLY = {"stability_threshold": 0, "confidence_threshold": 0.5}


@pytest.mark.parametrize("canvas,prompt_len,max_new,steps,stop", [
    (4, 6, 12, 6, {}),       # short prompt, three canvases, default stop rule
    (8, 21, 20, 8, EARLY),   # prompt longer than a canvas and the sliding window; max_new not a multiple of C
    (16, 3, 32, 10, EARLY),  # canvas longer than the sliding window
])
def test_generate_token_identical(ref, native, canvas, prompt_len, max_new, steps, stop):
    g = torch.Generator().manual_seed(canvas * 100 + prompt_len)
    prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g).tolist()
    seed = 1000 + canvas
    want = ref_generate(ref, prompt, seed, canvas, max_new_tokens=max_new, max_denoising_steps=steps,
                        **stop)[:max_new]
    eng = _engine(native)
    seq = eng.add_request(prompt, GenerationParams(max_tokens=max_new, steps=steps, block_size=canvas, seed=seed,
                                                   **stop))
    eng.run_to_completion()
    assert seq.output_ids == want
    assert seq.finish_reason == "length"
    assert seq.stats.forwards == seq.stats.denoise_steps  # encoder passes ride along with decoder steps
    if stop:
        assert seq.stats.denoise_steps < math.ceil(max_new / canvas) * steps  # canvases stopped early


def test_chunked_prefill_and_logprobs(ref, native):
    """A prompt longer than the step's token budget is encoded alone in chunks first; same tokens."""
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, VOCAB, (45,), generator=g).tolist()
    want = ref_generate(ref, prompt, 8, 8, max_new_tokens=16, max_denoising_steps=5)
    eng = _engine(native, max_batch_tokens=16)
    seq = eng.add_request(prompt, GenerationParams(max_tokens=16, steps=5, seed=8, logprobs=True))
    lps = []
    while eng.has_unfinished():
        for out in eng.step():
            lps += out.new_logprobs or []
    assert seq.output_ids == want
    assert seq.stats.forwards > seq.stats.denoise_steps  # encoder-only chunks ran first
    assert len(lps) == 16 and all(lp <= 0 for lp in lps)


@pytest.mark.parametrize("budget", [4096, 16])  # one [prompt ; canvas] forward, or 16-token encoder chunks first
def test_long_encoder_generation_token_identical(ref, native, long_encoder_spy, budget):
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (45,), generator=g).tolist()
    want = ref_generate(ref, prompt, 9, 8, max_new_tokens=16, max_denoising_steps=5)
    eng = _engine(native, max_batch_tokens=budget)
    seq = eng.add_request(prompt, GenerationParams(max_tokens=16, steps=5, seed=9))
    eng.run_to_completion()
    assert seq.output_ids == want
    assert "attend_banded" in long_encoder_spy
    if budget == 16:  # later chunks: the full layer sees the cached prefix whole and its own keys causally
        assert "attend_prefix_causal" in long_encoder_spy


def test_sliding_cache_keeps_only_the_window():
    """GemmaKVCache against a cache that keeps everything: the keys a sliding layer reads (from start - (W - 1)
    to the segment's end) are the same at every step, through growth, in-place compaction and shrinking after
    a long chunk, while its buffers stay O(W + segment) rows."""
    from unmask.models.diffusion_gemma import GemmaKVCache

    window, shapes, sliding = 16, [(2, 4), (1, 8)], [True, False]
    cache = GemmaKVCache(shapes, sliding, window, torch.float32, "cpu", capacity=8)
    full = [torch.zeros(h, 400, d) for h, d in shapes]
    g = torch.Generator().manual_seed(0)
    # (encoder tokens, canvas scratch tokens) per step: chunked prefill, canvases, a long chunk, canvases again
    plan = [(16, 0), (16, 0), (9, 4), (0, 4), (4, 4), (4, 4), (0, 4), (4, 4), (120, 4)] + [(4, 4)] * 12
    most_rows, moves = [], []
    for n_enc, n_dec in plan:
        start, n = cache.length, n_enc + n_dec
        rows, base = cache.rows, cache.base
        seg = Segment(start=start, length=n, write=n_enc, cache=cache)
        seg.prepare()
        if cache.base != base:
            moves.append("in place" if cache.rows == rows else "resized")
        for layer, (h, d) in enumerate(shapes):
            kv = torch.randn(h, n, d, generator=g)
            off = cache.first_position(layer)
            cache.k[layer][:, start - off:start + n - off] = kv
            full[layer][:, start:start + n] = kv
            lo = max(0, start - window + 1) if sliding[layer] else 0
            assert torch.equal(cache.k[layer][:, lo - off:start + n - off], full[layer][:, lo:start + n])
        cache.length = start + n_enc
        most_rows.append(cache.rows)
    assert cache.base > 0 and cache.length == 221
    assert "in place" in moves and "resized" in moves            # both ways of moving the window ran
    assert max(most_rows) <= 2 * (window - 1 + 124)          # the long chunk's need, doubled
    assert cache.rows <= 4 * (window - 1 + 8)                  # shrunk again afterwards
    assert cache.capacity >= cache.length                      # the full layer keeps every position
    with pytest.raises(ValueError, match="already dropped"):
        cache.truncate(cache.base)
        cache.reserve(cache.base + 4, cache.base)


def test_long_generation_through_the_sliding_window_cache(ref, native):
    """Sixteen canvases after a chunked prompt: the sliding layers' window moves on past the prompt and the
    tokens still equal the reference's (which keeps its own sliding cache)."""
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(3, VOCAB, (45,), generator=g).tolist()
    want = ref_generate(ref, prompt, 21, 4, max_new_tokens=64, max_denoising_steps=3)
    eng = _engine(native, max_batch_tokens=16)
    seq = eng.add_request(prompt, GenerationParams(max_tokens=64, steps=3, block_size=4, seed=21))
    cache = seq.cache
    eng.run_to_completion()
    assert seq.output_ids == want[:64]
    assert cache.base > 45                                     # the window moved on past the prompt
    assert cache.rows < 45 + 64                                # fewer rows than positions
    sliding_layer = native[1].arch.layer_types.index("sliding_attention")
    assert cache.k[sliding_layer].shape[1] == cache.rows


def test_generate_token_identical_other_settings(ref, native):
    """Non-default entropy bound, schedule and stop rule, passed per request."""
    prompt = list(range(10, 30))
    kw = dict(max_denoising_steps=9, sampler_config=gen_ref.EntropyBoundSamplerConfig(entropy_bound=0.5),
              t_min=0.1, t_max=1.3, stability_threshold=2, confidence_threshold=0.05)
    want = ref_generate(ref, prompt, 77, 8, max_new_tokens=24, **kw)
    eng = _engine(native)
    seq = eng.add_request(prompt, GenerationParams(max_tokens=24, steps=9, seed=77, entropy_bound=0.5, t_min=0.1,
                                                   t_max=1.3, stability_threshold=2, confidence_threshold=0.05))
    eng.run_to_completion()
    assert seq.output_ids == want


def test_generate_stops_at_eos_like_reference(ref, native):
    prompt = list(range(40, 52))
    free = ref_generate(ref, prompt, 5, 4, max_new_tokens=16, max_denoising_steps=6)
    eos = free[9]  # a token of the third canvas: both must stop there
    want = ref_generate(ref, prompt, 5, 4, max_new_tokens=16, max_denoising_steps=6, eos_token_id=eos,
                        pad_token_id=0)
    eng = _engine(native)
    seq = eng.add_request(prompt, GenerationParams(max_tokens=16, steps=6, block_size=4, seed=5,
                                                   stop_token_ids=[eos]))
    eng.run_to_completion()
    assert seq.output_ids == cut_at_eos(want, eos)
    assert seq.finish_reason == "stop"


def test_batch_is_token_identical_per_row(ref, native):
    """Concurrent requests (different prompts, canvas lengths, step caps) in one engine: every row equals
    the reference's batch-1 run with that row's seed, i.e. batching changes nothing."""
    g = torch.Generator().manual_seed(9)
    cases = [(5, 8, 6), (19, 4, 5), (2, 8, 8), (33, 16, 4), (11, 8, 6)]
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n, _, _ in cases]
    eng = _engine(native)
    seqs = [eng.add_request(p, GenerationParams(max_tokens=16, steps=s, block_size=c, seed=50 + i, **EARLY))
            for i, (p, (_, c, s)) in enumerate(zip(prompts, cases))]
    eng.run_to_completion()
    for i, (p, (_, c, s)) in enumerate(zip(prompts, cases)):
        want = ref_generate(ref, p, 50 + i, c, max_new_tokens=16, max_denoising_steps=s, **EARLY)[:16]
        assert seqs[i].output_ids == want


def test_decode_graph_replays_are_token_identical(ref, native):
    """The CUDA-graph path's bookkeeping, emulated on the CPU (the forward re-run on the graph's static buffers):
    a canvas step's first sighting runs eagerly, the second captures, later ones replay; tokens equal the
    reference's, alone and batched (where the batch's make-up changes and, with room for two graphs, old
    ones are dropped), and the step timing still counts the replays."""
    from unmask.engine.graphs import DecodeGraphs

    model, spec = native
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, VOCAB, (11,), generator=g).tolist()
    want = ref_generate(ref, prompt, 7, 8, max_new_tokens=24, max_denoising_steps=8)[:24]
    eng = _engine(native)
    graphs = eng.runner.graphs = DecodeGraphs(model, torch.device("cpu"), max_graphs=2, emulate=True)
    seq = eng.add_request(prompt, GenerationParams(max_tokens=24, steps=8, block_size=8, seed=7))
    eng.run_to_completion()
    assert seq.output_ids == want
    # 3 canvases x 8 steps: step 1 has no self-conditioning (eager), step 2 warms up, step 3 captures, 4-8 replay
    assert (graphs.captures, graphs.replays) == (3, 18)
    assert eng.stats.forward_s > 0

    cases = [(5, 8, 6), (19, 4, 5), (2, 8, 8), (33, 16, 4), (11, 8, 6)]
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n, _, _ in cases]
    eng = _engine(native)
    graphs = eng.runner.graphs = DecodeGraphs(model, torch.device("cpu"), max_graphs=2, emulate=True)
    seqs = [eng.add_request(p, GenerationParams(max_tokens=16, steps=s, block_size=c, seed=60 + i, **EARLY))
            for i, (p, (_, c, s)) in enumerate(zip(prompts, cases))]
    eng.run_to_completion()
    first = seqs
    for i, (p, (_, c, s)) in enumerate(zip(prompts, cases)):
        assert seqs[i].output_ids == ref_generate(ref, p, 60 + i, c, max_new_tokens=16, max_denoising_steps=s,
                                                  **EARLY)[:16]
    assert graphs.replays > 0 and len(graphs.graphs) <= 2

    # a memory budget below one graph's logits keeps only the newest graph, and replays still agree
    eng = _engine(native)
    graphs = eng.runner.graphs = DecodeGraphs(model, torch.device("cpu"), max_bytes=1, emulate=True)
    seqs = [eng.add_request(p, GenerationParams(max_tokens=16, steps=s, block_size=c, seed=60 + i, **EARLY))
            for i, (p, (_, c, s)) in enumerate(zip(prompts, cases))]
    eng.run_to_completion()
    assert [s.output_ids for s in seqs] == [r.output_ids for r in first]
    assert len(graphs.graphs) == 1 and graphs.captures > 1


@contextmanager
def per_row_randomness(seeds: list[int], canvas: int, vocab: int):
    """Make the reference's batched `generate` draw each row's randomness from that row's own generator,
    only while the row is active (not finished denoising / not finished) -- the randomness a batch-1 run of
    that row would draw. Tracks the rows' state through the reference's own stopping objects."""
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    b = len(seeds)
    done_seq = torch.zeros(b, dtype=torch.bool)
    done_den = torch.zeros(b, dtype=torch.bool)
    orig = (gen_ref.EntropyBoundSampler.initialize_canvas, gen_ref.EntropyBoundSampler.renoise_canvas,
            torch.multinomial, gen_ref.StableAndConfidentStoppingCriteria.__call__,
            gen_ref.DiffusionGemmaGenerationMixin._finalize_canvas)

    def draw(rows):
        out = torch.zeros(b, canvas, dtype=torch.long)
        for i in rows.nonzero()[:, 0].tolist():
            out[i] = torch.randint(0, vocab, (1, canvas), generator=gens[i])[0]
        return out

    def initialize_canvas(self, batch_size, device):
        done_den.zero_()
        return draw(~done_seq)

    def renoise_canvas(self, accepted, cur_step):
        return torch.where(~self.accepted_token_mask, draw(~done_seq & ~done_den), accepted)

    def multinomial(probs, num_samples, *a, **k):
        out = torch.zeros(probs.shape[0], num_samples, dtype=torch.long)
        for i in (~done_seq & ~done_den).nonzero()[:, 0].tolist():
            out[i * canvas:(i + 1) * canvas] = orig[2](probs[i * canvas:(i + 1) * canvas], num_samples,
                                                       generator=gens[i])
        return out

    def stop_call(self, argmax_canvas, logits, **k):
        r = orig[3](self, argmax_canvas, logits, **k)
        done_den.logical_or_(r)
        return r

    def finalize(*a, **k):
        ids, finished = orig[4](*a, **k)
        done_seq.copy_(finished)
        return ids, finished

    gen_ref.EntropyBoundSampler.initialize_canvas = initialize_canvas
    gen_ref.EntropyBoundSampler.renoise_canvas = renoise_canvas
    torch.multinomial = multinomial
    gen_ref.StableAndConfidentStoppingCriteria.__call__ = stop_call
    gen_ref.DiffusionGemmaGenerationMixin._finalize_canvas = staticmethod(finalize)
    try:
        yield
    finally:
        gen_ref.EntropyBoundSampler.initialize_canvas, gen_ref.EntropyBoundSampler.renoise_canvas = orig[:2]
        torch.multinomial = orig[2]
        gen_ref.StableAndConfidentStoppingCriteria.__call__ = orig[3]
        gen_ref.DiffusionGemmaGenerationMixin._finalize_canvas = staticmethod(orig[4])


def test_reference_batch_generate_matches_with_per_row_randomness(ref, native):
    """The reference's own batch > 1 `generate` (lockstep rows, early-stopped rows frozen, finished rows
    padded), with each row's randomness supplied from that row's generator: equal to unmask's concurrent
    requests row for row, through early stops and an EOS in one row."""
    g = torch.Generator().manual_seed(21)
    prompts = torch.randint(3, VOCAB, (3, 14), generator=g)
    seeds = [31, 32, 33]
    ref.config.canvas_length = 8
    free = []
    for p, s in zip(prompts.tolist(), seeds):
        free.append(ref_generate(ref, p, s, 8, max_new_tokens=32, max_denoising_steps=7, **EARLY))
    eos = free[1][12]  # row 1 stops in its second canvas; the others run on (unless they emit it too)
    with per_row_randomness(seeds, 8, VOCAB):
        out = ref.generate(prompts, max_new_tokens=32, max_denoising_steps=7, eos_token_id=eos, pad_token_id=0,
                           **EARLY)
    want = [cut_at_eos(row[14:], eos) for row in out.sequences.tolist()]
    eng = _engine(native)
    seqs = [eng.add_request(p, GenerationParams(max_tokens=32, steps=7, seed=s, stop_token_ids=[eos], **EARLY))
            for p, s in zip(prompts.tolist(), seeds)]
    eng.run_to_completion()
    assert [s.output_ids for s in seqs] == want
    assert seqs[1].finish_reason == "stop" and len(want[1]) <= 12


def test_snapshots_show_the_draft(native):
    eng = _engine(native)
    seq = eng.add_request(list(range(3, 12)), GenerationParams(max_tokens=16, steps=4, seed=1, snapshots=True))
    frames = []
    while eng.has_unfinished():
        frames += [o.snapshot for o in eng.step() if o.snapshot is not None]
    assert frames and all(len(f) <= 16 for f in frames)
    assert any(len(f) == 8 for f in frames)  # the first canvas's draft while it diffuses
    assert frames[-1][:8] == seq.output_ids[:8]


def test_top_logprobs_of_a_canvas(native):
    eng = _engine(native)
    seq = eng.add_request(list(range(3, 12)), GenerationParams(max_tokens=12, steps=4, seed=1, logprobs=True,
                                                               top_logprobs=3))
    lps, tops = [], []
    while eng.has_unfinished():
        for out in eng.step():
            lps += out.new_logprobs or []
            tops += out.new_top_logprobs or []
    assert len(tops) == len(seq.output_ids) == 12
    for tok, lp, top in zip(seq.output_ids, lps, tops):  # the canvas answer is the argmax draft
        assert len(top) == 3 and top[0][0] == tok and top[0][1] == pytest.approx(lp, abs=1e-5)


def test_logit_bias_steers_the_canvas(native):
    """+100 on one token: every canvas position drafts it, confidently, alone or batched."""
    eng = _engine(native)
    seqs = [eng.add_request(list(range(3, 12)), GenerationParams(max_tokens=16, steps=4, seed=s, ignore_eos=True,
                                                                 logit_bias={7: 100.0}, uniform_draws=d))
            for s, d in ((1, "reference"), (2, "lean"), (3, "lean"))]
    eng.run_to_completion()
    assert all(s.output_ids == [7] * 16 for s in seqs)
    alone = _engine(native)
    seq = alone.add_request(list(range(3, 12)), GenerationParams(max_tokens=8, steps=4, seed=1, ignore_eos=True,
                                                                 logit_bias={7: -100.0}, frequency_penalty=2.0))
    alone.run_to_completion()
    assert len(seq.output_ids) == 8 and 7 not in seq.output_ids


# ---------------------------------------------------------------------------------------- requests and errors

def test_min_tokens_bans_stop_tokens_early(native):
    """min_tokens (vLLM's meaning) on whole canvases: the stop token a free run commits at output position 2
    ends the output there without it, and is banned at the first min_tokens positions with it."""
    prompt = list(range(40, 52))
    base = dict(max_tokens=16, steps=4, block_size=4, seed=5)
    eng = _engine(native)
    free = eng.add_request(prompt, GenerationParams(**base, ignore_eos=True))
    eng.run_to_completion()
    stop = free.output_ids[2]
    eng = _engine(native)
    cut = eng.add_request(prompt, GenerationParams(**base, stop_token_ids=[stop]))
    held = eng.add_request(prompt, GenerationParams(**base, stop_token_ids=[stop], min_tokens=6))
    eng.run_to_completion()
    assert cut.finish_reason == "stop" and len(cut.output_ids) <= 2
    assert len(held.output_ids) >= 6 and stop not in held.output_ids[:6]


def test_image_prompt_is_refused(native):
    eng = _engine(native)
    with pytest.raises(InvalidRequestError, match="image input"):
        eng.add_request([2, 5, IMAGE_ID, 7], GenerationParams(max_tokens=8))


def test_request_validation(native):
    with pytest.raises(InvalidRequestError):
        GenerationParams(t_min=0.5, t_max=0.4)
    with pytest.raises(InvalidRequestError):
        GenerationParams(stability_threshold=-1)
    with pytest.raises(InvalidRequestError):
        GenerationParams(confidence_threshold=0.0)
    eng = _engine(native)
    with pytest.raises(InvalidRequestError, match="top_k"):
        eng.add_request([3, 4], GenerationParams(max_tokens=8, top_k=5))
    with pytest.raises(InvalidRequestError, match="t_max"):  # t_max below the default t_min (0.4)
        eng.add_request([3, 4], GenerationParams(max_tokens=8, t_max=0.3))
    with pytest.raises(InvalidRequestError, match="dry_multiplier is not supported for the diffusion_gemma"):
        eng.add_request([3, 4], GenerationParams(max_tokens=8, dry_multiplier=0.8))


def test_generation_config_defaults_are_read(native, tmp_path):
    model, spec = native
    traits_gen = {"max_denoising_steps": 5, "sampler_config": {"entropy_bound": 0.25, "_cls_name": "x"},
                  "t_min": 0.2, "t_max": 0.9, "stability_threshold": 3, "confidence_threshold": 0.01}
    from unmask.engine.gemma_sequence import uniform_config
    cfg = uniform_config(GenerationParams(), traits_gen)
    assert (cfg.max_steps, cfg.entropy_bound, cfg.t_min, cfg.t_max, cfg.stability_threshold,
            cfg.confidence_threshold) == (5, 0.25, 0.2, 0.9, 3, 0.01)
    assert uniform_config(GenerationParams(steps=7, entropy_bound=0.3), traits_gen).max_steps == 7
    assert uniform_config(GenerationParams(), {}) == U.UniformConfig()  # the reference's global defaults


@pytest.mark.parametrize("change,feature", [
    (lambda c: c["text_config"].__setitem__("use_bidirectional_attention", "all"), "use_bidirectional_attention"),
    (lambda c: c["text_config"]["rope_parameters"]["full_attention"].__setitem__("rope_type", "yarn"), "yarn"),
    (lambda c: c["text_config"].__setitem__("num_experts", None), "mixture of experts"),
    (lambda c: c.__setitem__("tie_word_embeddings", False), "untied"),
])
def test_unsupported_configs_name_the_feature(ckpt, tmp_path, change, feature):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=feature):
        load_model(d)


def test_chat_template_and_server_stream(ckpt):
    """Served like every family: chat template, streaming deltas and `diffusing` frames (no masks)."""
    from unmask.engine.async_engine import AsyncEngine
    from unmask.engine.llm import LLM
    from unmask.server.metrics import Metrics
    from unmask.server.protocol import ChatCompletionRequest
    from unmask.server.serving import OpenAIServing, ServingConfig

    llm = LLM(ckpt, dtype="float32")
    ids = llm.chat_prompt([{"role": "user", "content": "hi"}])
    assert ids[0] == 2 and 259 in ids  # <bos>, <start_of_turn>
    engine = AsyncEngine(llm.engine)
    serving = OpenAIServing(llm, engine, Metrics(), ServingConfig(model_name="tiny"))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True,
                                diffusing=True, seed=3, steps=4, t_max=1.0)

    async def run():
        stream = await serving.chat(req)
        return [chunk async for chunk in stream]

    try:
        frames = asyncio.run(run())
    finally:
        engine.shutdown(drain=False)
    payloads = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    assert frames[-1].strip() == "data: [DONE]"
    diffusing = [p for p in payloads if p.get("diffusing")]
    assert diffusing and all(p["diffusing"]["masked"] == 0 for p in diffusing)
    finish = [c["finish_reason"] for p in payloads for c in p.get("choices", []) if c.get("finish_reason")]
    assert finish == ["length"]


# ---------------------------------------------------------------------------------------- structured output

@pytest.fixture(scope="module")
def structured_llm(ckpt, tmp_path_factory):
    """The tiny checkpoint with an end-of-sequence id in generation_config.json, as released checkpoints have
    (a grammar ends with it); the weights are the same file."""
    from unmask.engine.llm import LLM

    d = tmp_path_factory.mktemp("dgemma_eos")
    for f in ckpt.iterdir():
        if f.name != "generation_config.json":
            (d / f.name).symlink_to(f)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1]}))
    return LLM(d, dtype="float32")


def _chat(llm) -> list[int]:
    return llm.chat_prompt([{"role": "user", "content": "Answer in the requested format."}])


@pytest.mark.parametrize("draws", ["reference", "lean"])
def test_structured_output_on_the_uniform_canvas(structured_llm, draws):
    """Every constraint kind holds on a random model (its free output is byte noise), across canvases."""
    from test_structured import KINDS, checked

    from unmask.structured import StructuredSpec

    llm = structured_llm
    for kind, value in KINDS:
        for seed in (0, 1):
            # one token per byte here: the schema's shortest answer is ~70 tokens
            params = GenerationParams(max_tokens=128, structured=StructuredSpec(kind, value), seed=seed, steps=6,
                                      uniform_draws=draws)
            out = llm.generate(_chat(llm), params)[0]
            checked(kind, out.text, value)
            assert out.finish_reason == "stop" and len(out.token_ids) <= 128


def test_unconstrained_uniform_output_is_not_json(structured_llm):
    llm = structured_llm
    out = llm.generate(_chat(llm), GenerationParams(max_tokens=24, seed=0, steps=6))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("max_tokens", [3, 5, 13])
def test_structured_json_closes_within_max_tokens(structured_llm, max_tokens):
    """max_tokens inside a canvas (3, 5) and in the second canvas (13 with canvases of 8)."""
    from unmask.structured import StructuredSpec

    llm = structured_llm
    for seed in range(3):
        params = GenerationParams(max_tokens=max_tokens, structured=StructuredSpec.json_object(), seed=seed,
                                  steps=4, t_max=2.0)
        out = llm.generate(_chat(llm), params)[0]
        assert isinstance(json.loads(out.text), dict), out.text
        assert len(out.token_ids) <= max_tokens and out.finish_reason == "stop"


def test_structured_tokens_replay_and_logprobs(structured_llm):
    """A fresh matcher accepts the output and its stop token in order; logprobs and top_logprobs cover every
    output token, the top entry of each being the committed token (greedy under the grammar's mask)."""
    from test_structured import PERSON

    from unmask.structured import StructuredSpec

    llm = structured_llm
    spec = StructuredSpec.json_schema(PERSON)
    seq = llm.engine.add_request(_chat(llm), GenerationParams(max_tokens=128, structured=spec, seed=3, steps=6,
                                                              logprobs=True, top_logprobs=2))
    tops = []
    while llm.engine.has_unfinished():
        tops += [t for o in llm.engine.step() if o.request_id == seq.request_id for t in (o.new_top_logprobs or [])]
    assert seq.finish_reason == "stop"
    ids = seq.output_ids + [1]
    fresh = llm.engine.structured_backend().constraint(spec).m
    assert fresh.validate_tokens(ids) == len(ids)
    assert torch.isfinite(seq.logprobs[: seq.num_generated]).all()
    assert len(tops) == seq.num_generated


def test_structured_request_batched_with_free_ones(structured_llm):
    """A constrained canvas steps alone while free requests share the batched denoising step: their tokens
    are those they get alone."""
    from unmask.structured import StructuredSpec

    llm = structured_llm
    free = [GenerationParams(max_tokens=16, steps=4, seed=s, ignore_eos=True) for s in (1, 2)]
    alone = [o.token_ids for o in llm.generate([_chat(llm)] * 2, free)]
    spec = StructuredSpec("regex", r"[0-9]{3}-[a-z]{2,5}")
    outs = llm.generate([_chat(llm)] * 3, free + [GenerationParams(max_tokens=16, structured=spec, seed=0)])
    assert [o.token_ids for o in outs[:2]] == alone
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", outs[2].text)


def test_forced_tool_call_text_costs_no_forward(structured_llm):
    """A named call in Gemma 4 syntax is mostly forced text: several tokens per forward on a random model."""
    from test_structured import WEATHER

    from unmask.structured import StructuredSpec
    from unmask.structured.tools import GEMMA4, call_grammar, check_tools

    llm = structured_llm
    grammar = call_grammar(GEMMA4, check_tools([WEATHER]), "get_weather", False, {})
    # one token per byte, tags and quotes spelt out: the shortest call is ~75 tokens
    out = llm.generate(_chat(llm), GenerationParams(max_tokens=128, structured=StructuredSpec("lark", grammar),
                                                    seed=0, steps=6))[0]
    assert out.text.startswith("<|tool_call>call:get_weather{") and out.text.endswith("}<tool_call|>"), out.text
    assert len(out.token_ids) / out.forwards > 2.0


def test_tool_choice_required_and_json_schema_served(structured_llm):
    """Through the server layer: tool_choice required gives an OpenAI tool call with schema-valid JSON
    arguments (parsed from Gemma 4 syntax), and response_format json_schema gives valid JSON content."""
    import jsonschema
    from test_structured import PERSON, WEATHER

    from unmask.engine.async_engine import AsyncEngine
    from unmask.server.metrics import Metrics
    from unmask.server.protocol import ChatCompletionRequest
    from unmask.server.serving import OpenAIServing, ServingConfig

    engine = AsyncEngine(structured_llm.engine)
    serving = OpenAIServing(structured_llm, engine, Metrics(), ServingConfig(model_name="tiny"))
    user = [{"role": "user", "content": "Weather in Rome?"}]
    tool_req = ChatCompletionRequest(messages=user, tools=[WEATHER], tool_choice="required", max_tokens=128,
                                     seed=0, steps=6)
    json_req = ChatCompletionRequest(messages=user, max_tokens=128, seed=1, steps=6, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})

    async def run():
        return await serving.chat(tool_req), await serving.chat(json_req)

    try:
        tool_resp, json_resp = asyncio.run(run())
    finally:
        engine.shutdown(drain=False)
    tool_choice = tool_resp.choices[0]
    assert tool_choice.finish_reason == "tool_calls"
    call = tool_choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    # string lengths are not enforced in Gemma 4 syntax (structured/gemma4.py GrammarWriter); the rest is
    params = json.loads(json.dumps(WEATHER["function"]["parameters"]))
    del params["properties"]["city"]["maxLength"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    jsonschema.validate(json.loads(json_resp.choices[0].message.content), PERSON)
