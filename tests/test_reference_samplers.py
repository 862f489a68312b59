"""Each family's reference sampler, rewritten densely from its published algorithm, against the engine at the
reference's settings: token for token (issue 30, items 9-12).

The samplers below follow the generation procedures in docs/families.md (copy: /work/shared/reference/families.md;
sections cited per function), not the engine's code: every step recomputes the whole canvas with the independent
float32 forward of tests/reference_forward.py (no cache), under the attention the reference uses. One deliberate
difference from the references, shared with the engine: the mask token itself is never proposed.
DiffusionGemma's sampler is checked against transformers' own `generate` in tests/test_diffusion_gemma.py
(test_generate_token_identical and the tests after it), so it is not repeated here.

The tiny checkpoints of tests/tiny_checkpoints.py predict one and the same token at every masked position (their
layers barely move the residual stream), so a wrong commit order would go unnoticed; `contextual` copies them with
the layers' matrices scaled up, which makes the predictions depend on position and context. Outputs are short and
`ignore_eos` is set on the engine, since none of these references stops inside a canvas the way the engine does.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_forward import load_config, load_weights, logits_from_weights
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams, model_defaults
from unmask.errors import ContextLengthError, InvalidRequestError
from unmask.models.loader import load_model

LAYER_SCALE = 15.0  # every matrix inside the layers (embeddings, norms and the head stay)
HEADS = ("lm_head.weight", "model.transformer.ff_out.weight")
EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings")
P13, P5, P40 = list(range(20, 33)), list(range(40, 45)), list(range(60, 100))


def contextual(src: Path, dst: Path, head_scale: float = 1.0, generation_config: str | None = None) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    w = load_file(str(f))
    for k, v in w.items():
        if k in HEADS:
            w[k] = v * head_scale
        elif v.dim() >= 2 and not any(e in k for e in EMBEDDINGS):
            w[k] = v * LAYER_SCALE
    save_file(w, str(f), metadata={"format": "pt"})
    if generation_config is not None:
        (dst / "generation_config.json").write_text(generation_config)
    return dst


@pytest.fixture(scope="module")
def ckpts(family_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("contextual")
    out = {f: contextual(family_dirs[f], root / f) for f in ("llada", "sdar", "fast_dllm_v2", "llada2")}
    # Dream's diffusion_generate reads top_p / top_k from the generation config, also at temperature 0
    out["dream"] = contextual(family_dirs["dream"], root / "dream",
                              generation_config='{"eos_token_id": 151643, "top_p": 0.95, "top_k": 3}')
    out["unmask"] = make_unmask(root / "unmask")
    return out


def make_unmask(out: Path) -> Path:
    """The built-in format as `unmask train --causal-context` exports it (shifted, causal context), with weights
    large enough that the logits are far from uniform."""
    from unmask.train.checkpoint import export_model
    from unmask.train.model_init import fresh_model, init_weights, new_unmask_config

    cfg = new_unmask_config(96, 32, 2, 4, 2, 8, 64, 256, 4, mask_id=3, eos_ids=[2], tie_embeddings=True)
    cfg["shift_logits"] = True
    cfg["causal_context"] = True
    tm = fresh_model(cfg, {"eos_token_id": [2]}, seed=0)
    init_weights(tm.model, 0, std=0.2)
    return export_model(tm, out, None)


_LOADED: dict[Path, tuple] = {}


def engine(d: Path, prompt: list[int], **kw):
    """The engine's output ids and its sequence, one request, `ignore_eos`."""
    if d not in _LOADED:
        _LOADED[d] = load_model(d)
    eng = Engine(*_LOADED[d])
    seq = eng.add_request(prompt, GenerationParams(ignore_eos=True, seed=0, **kw))
    eng.run_to_completion()
    return seq.output_ids, seq


class Dense:
    """The checkpoint's independent float32 forward over a whole canvas, mask token banned."""

    def __init__(self, d: Path, mask_id: int):
        self.cfg, self.w, self.mask = load_config(d), load_weights(d), mask_id
        self.forwards = 0

    def __call__(self, ids: list[int], attention: str, shift: bool = False) -> torch.Tensor:
        self.forwards += 1
        logits = logits_from_weights(self.cfg, self.w, torch.tensor([ids]), attention)[0]
        if shift:  # Dream / Fast-dLLM v2: token j is read from row j - 1 (the first row repeats)
            logits = torch.cat([logits[:1], logits[:-1]])
        logits[:, self.mask] = float("-inf")
        return logits


def even_split(total: int, steps: int) -> list[int]:
    return [total // steps + (1 if i < total % steps else 0) for i in range(steps)]


def top_by(conf: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n largest, ties to the lower index."""
    return torch.sort(conf, descending=True, stable=True).indices[:n]


# ------------------------------------------------------------------------------------------ the reference samplers
def llada_reference(f: Dense, prompt, gen_length, block_length, steps):
    """ML-GSAI/LLaDA generate.py, temperature 0, remasking low_confidence (families.md 1.5)."""
    x, P = prompt + [f.mask] * gen_length, len(prompt)
    nb = gen_length // block_length
    for b in range(nb):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        quota = even_split(sum(t == f.mask for t in x[lo:hi]), steps // nb)
        for j in range(steps // nb):
            logits = f(x, "bidirectional")
            p, x0 = torch.softmax(logits, -1).max(-1)
            conf = torch.full((len(x),), float("-inf"))
            for i in range(lo, hi):
                if x[i] == f.mask:
                    conf[i] = p[i]
            for i in top_by(conf, quota[j]).tolist():
                x[i] = int(x0[i])
    return x[P:]


def dream_reference(f: Dense, prompt, max_new_tokens, steps, alg, top_p=None, top_k=None, eps=1e-3):
    """Dream's diffusion_generate -> _sample, temperature 0 (families.md 2.5): one canvas, shifted logits,
    confidences of the top_p- then top_k-filtered softmax, n = int(M * (1 - s/t)) (all on the last step; 0 means
    the step commits nothing)."""
    x, P = prompt + [f.mask] * max_new_tokens, len(prompt)
    ts = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        masked = [j for j, t in enumerate(x) if t == f.mask]
        logits = f(x, "bidirectional", shift=True)[masked]
        if top_p is not None and top_p < 1:
            srt, idx = torch.sort(logits, descending=True)
            cum = torch.softmax(srt, -1).cumsum(-1)
            drop = cum > top_p
            drop[:, 1:] = drop[:, :-1].clone()
            drop[:, 0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), torch.finfo(logits.dtype).min)
        if top_k is not None:
            kth = torch.topk(logits, top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, -1)
        conf, x0 = probs.max(-1)
        if alg == "topk_margin":
            two = torch.sort(probs, -1, descending=True).values
            conf = two[:, 0] - two[:, 1]
        elif alg == "entropy":
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        m = torch.tensor(float(len(masked)))
        n = int(m * (1 - ts[i + 1] / ts[i])) if i < steps - 1 else len(masked)
        for r in top_by(conf, n).tolist():
            x[masked[r]] = int(x0[r])
    return x[P:]


def sdar_reference(f: Dense, prompt, gen_length, block, steps, remasking, threshold=0.9):
    """JetAstra/SDAR generate.py block_diffusion_generate with top_k 1 (its greedy), temperature 1 (families.md 3.5):
    absolute blocks over ceil((P + G) / B) * B positions, the last one decoded whole; with top_k 1 every p(x0) is 1."""
    P = len(prompt)
    total = -(-(P + gen_length) // block) * block
    x = prompt + [f.mask] * (total - P)
    quota = even_split(block, steps)
    for lo in range(P // block * block, total, block):
        hi = lo + block
        for it in range(steps + 1):
            masked = [i for i in range(lo, hi) if x[i] == f.mask]
            if not masked:
                break
            x0 = f(x[:hi], f"block_causal:{block}")[lo:hi].argmax(-1)
            conf = torch.ones(len(masked))  # p(x0) under the top-1 distribution
            n = min(quota[it], len(masked))
            if remasking == "low_confidence_dynamic" and int((conf > threshold).sum()) >= n:
                pick = (conf > threshold).nonzero().flatten()
            else:  # low_confidence_static, or too few above the threshold: the n most confident, ties by position
                pick = top_by(conf, n)
            for r in pick.tolist():
                x[masked[r]] = int(x0[masked[r] - lo])
    return x[P:P + gen_length]


def fast_dllm_v2_reference(f: Dense, prompt, blocks, block=32, small_block=8, threshold=0.9):
    """Fast_dLLM_QwenForCausalLM.generate, temperature 0 (families.md 4.4): absolute blocks; each block's masks are
    decoded sub-block by sub-block, committing p > threshold plus the sub-block's most confident mask; a complete
    block's last row gives the next block's first token greedily. `blocks` complete blocks; returns the tokens
    after the prompt."""
    def next_token(x):  # the row of the last token; the appended mask lies in the next block, unseen by it
        return int(f(x + [f.mask], f"block_causal:{block}", shift=True)[-1].argmax())

    x, P = list(prompt), len(prompt)
    if P % block == 0:  # the prompt ends a block: the next token comes from its last row
        x.append(next_token(x))
    for _ in range(blocks):
        x = x + [f.mask] * (-len(x) % block)
        lo = len(x) - block
        for s in range(lo, len(x), small_block):
            while f.mask in x[s:s + small_block]:
                logits = f(x, f"block_causal:{block}", shift=True)[s:s + small_block]
                p, x0 = torch.softmax(logits, -1).max(-1)
                masked = [i for i in range(small_block) if x[s + i] == f.mask]
                conf = p[masked]
                pick = set((conf > threshold).nonzero().flatten().tolist()) | {int(conf.argmax())}
                for r in pick:
                    x[s + masked[r]] = int(x0[masked[r]])
        x.append(next_token(x))  # the finished block's pass (K/V written) reads the next token off its last row
    return x[P:]


def llada2_reference(f: Dense, prompt, gen_length, block=32, steps=32, threshold=0.95):
    """LLaDA2MoeModelLM.generate, temperature 0 (families.md 5.5): ceil((P + G) / B) absolute blocks, each window
    recomputed; commit every mask with p > threshold if they reach the step's quota, else the quota most
    confident; the last block is decoded whole and the output cut at gen_length."""
    P = len(prompt)
    total = -(-(P + gen_length) // block) * block
    x = prompt + [f.mask] * (total - P)
    quota = even_split(block, min(steps, gen_length))
    for lo in range(P // block * block, total, block):
        hi = lo + block
        for it in range(len(quota)):
            masked = [i for i in range(lo, hi) if x[i] == f.mask]
            if not masked:
                break
            p, x0 = torch.softmax(f(x[:hi], f"block_causal:{block}")[lo:hi], -1).max(-1)
            conf = p[[i - lo for i in masked]]
            n = min(quota[it], len(masked))
            high = (conf > threshold).nonzero().flatten()
            pick = high if high.numel() >= n else top_by(conf, n)
            for r in pick.tolist():
                x[masked[r]] = int(x0[masked[r] - lo])
    return x[P:P + gen_length]


def unmask_reference(model, spec, prompt, max_tokens, threshold=0.9):
    """The built-in model's own procedure (docs/decoding.md, docs/architecture.md): absolute blocks of the
    checkpoint's size; committed text attends token-causally, the open block bidirectionally; shifted logits;
    each step commits p >= threshold plus the most confident mask, and a block's first token is always taken on
    its first step (it is read from the finished block before it). Dense: the engine model's uncached forward."""
    B, mask, P = spec.block_size, spec.mask_id, len(prompt)
    end = P + max_tokens
    x = torch.tensor(prompt + [mask] * max_tokens)
    for lo in range(P // B * B, end, B):
        hi, first = min(lo + B, end), True
        while (x[lo:hi] == mask).any():
            pos = torch.arange(hi)
            group = torch.where(pos < lo, pos, torch.tensor(lo))
            allowed = (group[None, :] <= group[:, None])[None, None]
            with torch.inference_mode():
                logits = model.logits(model.forward_dense(x[None, :hi], pos[None], allowed))[0].float()
            logits = torch.cat([logits[:1], logits[:-1]])
            logits[:, mask] = float("-inf")
            masked = (x[lo:hi] == mask).nonzero().flatten() + lo
            p, x0 = torch.softmax(logits[masked], -1).max(-1)
            pick = (p >= threshold) | (torch.arange(len(masked)) == p.argmax())
            if first and int(masked[0]) == lo:
                pick[0] = True
            x[masked[pick]] = x0[pick]
            first = False
    return x[P:].tolist()


# ------------------------------------------------------------------------------------------ engine == reference
@pytest.mark.parametrize("prompt, max_tokens, full", [(P13, 19, None), (P5, 27, None), (P40, 24, None),
                                                      (P13, 24, True)])
def test_fast_dllm_v2_defaults_are_its_reference_generate(ckpts, prompt, max_tokens, full):
    """Sub-blocks of 8 inside the checkpoint's 32-token blocks, threshold 0.9 (its scripts), with no sub-block
    setting in the request: the family default. Where the output ends inside a block, the reference decodes
    that block whole, which full_last_block reproduces."""
    d = ckpts["fast_dllm_v2"]
    ref = Dense(d, 151665)
    got, seq = engine(d, prompt, max_tokens=max_tokens, threshold=0.9, full_last_block=full)
    assert seq.params.small_block_size == 8 and seq.B == 32
    want = fast_dllm_v2_reference(ref, prompt, blocks=-(-(len(prompt) + max_tokens) // 32) - len(prompt) // 32)
    assert got == want[:max_tokens]
    if full is None:  # without sub-blocks (the block size turns them off) the tokens differ
        assert engine(d, prompt, max_tokens=max_tokens, threshold=0.9, small_block_size=32)[0] != got


@pytest.mark.parametrize("alg", ["maskgit_plus", "entropy", "topk_margin"])
@pytest.mark.parametrize("max_tokens, steps", [(12, 12), (12, 5)])
def test_dream_defaults_are_its_reference_sampler(ckpts, alg, max_tokens, steps):
    """Temperature 0 with the generation config's top_p 0.95 / top_k 3 shaping the confidences, and the linear
    schedule's zero-token steps, with nothing but the policy, steps and one block in the request."""
    d = ckpts["dream"]
    want = dream_reference(Dense(d, 151666), P13, max_tokens, steps, alg, top_p=0.95, top_k=3)
    got, seq = engine(d, P13, max_tokens=max_tokens, policy=alg, steps=steps, block_size=max_tokens)
    assert got == want
    assert seq.params.greedy_filters and seq.params.empty_steps and (seq.params.top_k, seq.params.top_p) == (3, 0.95)
    if steps == max_tokens:  # int(12 * (1 - s/t)) is 0 on the first steps: forwards that commit nothing
        assert seq.stats.forwards == steps > seq.stats.denoise_steps


def test_dream_engine_rules_stay_available(ckpts):
    """greedy_filters / empty_steps off: the engine's own rules (full-softmax confidences, at least one token per
    step), which here give other tokens and fewer forwards than the reference."""
    d = ckpts["dream"]
    kw = dict(max_tokens=12, policy="entropy", steps=12, block_size=12)
    ref, _ = engine(d, P13, **kw)
    own, seq = engine(d, P13, **kw, greedy_filters=False, empty_steps=False)
    assert seq.params.top_k == 0 and seq.stats.forwards == seq.stats.denoise_steps == 12
    assert own != ref
    assert engine(d, P13, **kw, top_k=3, top_p=0.95, empty_steps=False)[1].stats.forwards == 12


@pytest.mark.parametrize("gen_length, block_length, steps", [(16, 8, 8), (16, 16, 16), (12, 4, 6)])
def test_llada_is_its_reference_generate(ckpts, gen_length, block_length, steps):
    d = ckpts["llada"]
    want = llada_reference(Dense(d, 126336), P13, gen_length, block_length, steps)
    got, _ = engine(d, P13, max_tokens=gen_length, policy="low_confidence", block_size=block_length,
                    steps=steps // (gen_length // block_length))
    assert got == want


@pytest.mark.parametrize("prompt, max_tokens", [(P13, 10), (P40, 12), (P5, 17)])
def test_llada2_is_its_reference_generate_with_the_full_last_block(ckpts, prompt, max_tokens):
    """Threshold 0.95 with as many steps as block positions (its defaults: 32 and 32), so the step quota is one
    token and the rule is the engine's threshold rule; blocks of 8 keep the dense MoE reference fast (at 32 the
    reference caps its steps at gen_length, which for outputs this short raises the quota). The output ends
    inside a block, which the reference decodes whole."""
    d = ckpts["llada2"]
    want = llada2_reference(Dense(d, 156895), prompt, max_tokens, block=8, steps=8)
    got, seq = engine(d, prompt, max_tokens=max_tokens, threshold=0.95, block_size=8, full_last_block=True)
    assert got == want and len(got) == max_tokens
    assert engine(d, prompt, max_tokens=max_tokens, threshold=0.95, block_size=8)[0] != got  # cut short: others


@pytest.mark.parametrize("remasking, policy", [("low_confidence_dynamic", "threshold"),
                                               ("low_confidence_static", "low_confidence")])
@pytest.mark.parametrize("prompt, max_tokens", [(P13, 10), (P5, 9)])
def test_sdar_is_its_reference_generate_with_the_full_last_block(ckpts, remasking, policy, prompt, max_tokens):
    """Block 4, 4 steps, top_k 1 at temperature 1 (SDAR's greedy: every p(x0) is 1, so the dynamic rule commits a
    block per step and the static one a token per step, left to right)."""
    d = ckpts["sdar"]
    want = sdar_reference(Dense(d, 151669), prompt, max_tokens, 4, 4, remasking)
    kw = dict(max_tokens=max_tokens, policy=policy, threshold=0.9, steps=4, temperature=1.0, top_k=1)
    got, _ = engine(d, prompt, **kw, full_last_block=True)
    assert got == want
    assert engine(d, prompt, **kw)[0] != got  # the default cuts the last block short


def test_unmask_builtin_is_its_documented_procedure(ckpts):
    d = ckpts["unmask"]
    model, spec = _LOADED.setdefault(d, load_model(d))
    for prompt in ([5, 6, 7], [9] * 8, list(range(10, 21))):
        got, seq = engine(d, prompt, max_tokens=14)
        assert got == unmask_reference(model, spec, prompt, 14)
        assert seq.stats.forwards < 14 + 3  # some steps commit several tokens


# ------------------------------------------------------------------------------------------ defaults and checks
def test_model_defaults_and_generation_config_overrides():
    assert model_defaults("fast_dllm_v2", {}) == {"small_block_size": 8}
    assert model_defaults("fast_dllm_v2", {"small_block_size": 4})["small_block_size"] == 4
    assert model_defaults("fast_dllm_v2", {"small_block_size": None})["small_block_size"] is None
    assert model_defaults("fast_dllm_v2", {"small_block_size": "8"})["small_block_size"] == 8  # ignored
    assert model_defaults("dream", {"top_p": 0.9, "top_k": 20}) == {
        "greedy_filters": True, "empty_steps": True, "small_block_size": None, "top_k": 20, "top_p": 0.9}
    assert model_defaults("dream", {"greedy_filters": False, "top_p": 0.9}) == {
        "greedy_filters": False, "empty_steps": True, "small_block_size": None}
    assert model_defaults("sdar", {"full_last_block": True, "top_k": 20}) == {
        "full_last_block": True, "small_block_size": None}
    assert model_defaults("llada", {}) == {"small_block_size": None}


def test_the_subblock_default_yields_to_the_request(ckpts):
    d = ckpts["fast_dllm_v2"]
    assert engine(d, P5, max_tokens=4, block_size=4)[1].sub is None        # 8 does not divide 4: no default
    assert engine(d, P5, max_tokens=4, block_size=16)[1].sub == 8
    assert engine(d, P5, max_tokens=4, small_block_size=4)[1].sub == 4
    assert engine(ckpts["sdar"], P5, max_tokens=4)[1].sub is None           # other families: none


def test_full_last_block_runs_to_the_block_end_and_cuts_the_output(ckpts):
    _, seq = engine(ckpts["sdar"], P13, max_tokens=6, full_last_block=True, policy="topk", tokens_per_step=1)
    assert seq.canvas_end == 20 and len(seq.output_ids) == 6 and seq.finish_reason == "length"
    _, seq = engine(ckpts["sdar"], P13, max_tokens=7, full_last_block=True)
    assert seq.canvas_end == seq.end == 20  # already whole blocks


@pytest.mark.parametrize("kw, param", [
    (dict(greedy_filters=1), "greedy_filters"), (dict(empty_steps="yes"), "empty_steps"),
    (dict(full_last_block=0), "full_last_block"),
])
def test_bad_switches_name_the_field(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        GenerationParams(**kw)
    assert e.value.param == param and "must be true, false or null" in str(e.value)


def test_full_last_block_is_checked_against_the_family_and_the_context(ckpts):
    d = ckpts["llada"]
    _LOADED.setdefault(d, load_model(d))
    with pytest.raises(InvalidRequestError, match="full_last_block needs a block-causal family") as e:
        Engine(*_LOADED[d]).check_request(P13, GenerationParams(full_last_block=True))
    assert e.value.param == "full_last_block"
    d = ckpts["sdar"]
    _LOADED.setdefault(d, load_model(d))
    eng = Engine(*_LOADED[d])
    ctx = eng.traits.max_context
    assert ctx % 6  # blocks of 6 do not tile the context: the last one would end past it
    eng.check_request([5] * 3, GenerationParams(max_tokens=ctx - 3, block_size=6))
    with pytest.raises(ContextLengthError, match="rounded up to whole blocks of 6") as e:
        eng.check_request([5] * 3, GenerationParams(max_tokens=ctx - 3, block_size=6, full_last_block=True))
    assert e.value.param == "max_tokens"


def test_the_server_takes_the_switches_and_answers_400_naming_them(ckpts):
    """Through the HTTP app in-process: full_last_block reaches the engine (the tokens of LLM.generate with it)
    and is a 400 naming it on a family without blocks of its own."""
    from fastapi.testclient import TestClient

    from unmask.engine.llm import LLM
    from unmask.server.app import ServerArgs, create_app

    body = {"model": "tiny", "prompt": P13, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "full_last_block": True, "greedy_filters": False, "empty_steps": None}
    with TestClient(create_app(ServerArgs(model=ckpts["sdar"], served_model_name="tiny"))) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not load"
            time.sleep(0.05)
        ok = client.post("/v1/completions", json=body)
        bad = client.post("/v1/completions", json={**body, "full_last_block": "often"})
    assert ok.status_code == 200, ok.text
    want = LLM(ckpts["sdar"]).generate([P13], GenerationParams(max_tokens=6, ignore_eos=True, full_last_block=True))
    assert ok.json()["choices"][0]["text"] == want[0].text
    assert bad.status_code == 400 and "full_last_block" in bad.text
