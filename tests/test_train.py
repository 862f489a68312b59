"""Trainer tests on a tiny model (vocab 64, hidden 32, 2 layers, seq 32) and a char tokenizer."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import socket
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from unmask.models.loader import load_model
from unmask.models.registry import family_for
from unmask.models.transformer import DiffusionTransformer
from unmask.train.checkpoint import CheckpointError
from unmask.train.data import BatchIterator, DataError, pack_documents
from unmask.train.model_init import ModelShape, init_weights
from unmask.train.objectives import (Noise, Objective, block_diffusion_mask, bucket_rows, diffusion_loss_sum, draw_noise,
                                     head_logits)
from unmask.train.sft import SFTEncoder, load_sft, read_jsonl
from unmask.train.trainer import TrainConfig, TrainConfigError, TrainDivergedError, finetune, train

TINY = ModelShape(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=64, max_position=128, block_size=4)
TEXT = "the cat sat on the mat. the dog ate the bone. "
CHARS = "abcdefghijklmnopqrstuvwxyz \n.,:;!?'\"()=_-+*#{}"  # ids 16..61; 62, 63 stay free


# ------------------------------------------------------------------ fixtures

def write_char_tokenizer(out: Path) -> Path:
    """Char-level tokenizer with unmask's 16 special tokens at ids 0..15 and its ChatML template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from unmask.train.tokenizer import SPECIAL_TOKENS, hf_tokenizer_config

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|reserved_0|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(128)))
    return out


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory) -> Path:
    return write_char_tokenizer(tmp_path_factory.mktemp("tok"))


def write_corpus(d: Path, text: str, n: int = 8) -> Path:
    """A corpus directory of `n` copies of `text` as documents, the first also held out."""
    docs = [{"source": "t", "path": f"d{i}", "text": text} for i in range(n)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in docs))
    (d / "heldout.jsonl").write_text(json.dumps(docs[0]) + "\n")
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), TEXT * 3)


def tiny_cfg(out: Path, **kw) -> TrainConfig:
    base = dict(out_dir=str(out), lr=1e-2, warmup_steps=2, total_steps=6, batch_size=4, seq_len=32,
                block_sizes=(4, 8, 16, 32), eval_every=0, save_every=0, bf16=False, device="cpu",
                progress="none", model=TINY)
    base.update(kw)
    return TrainConfig(**base)


def tiny_model(seed: int = 0) -> DiffusionTransformer:
    cfg = {"architectures": ["UnmaskForDiffusionLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64}
    m = DiffusionTransformer(family_for(cfg).parse_config(cfg))
    init_weights(m, seed, std=0.2)  # large weights: logits far from uniform, so mistakes show
    return m


def logits_all(model, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return model.logits(model.forward_dense(ids, pos, None))


# ------------------------------------------------------------------ objective

def test_the_heads_row_count_repeats_from_step_to_step_and_the_logits_and_gradients_do_not_change():
    assert [bucket_rows(n) for n in (1, 64, 65, 100, 1000, 1024, 1025, 3000)] == [1, 64, 72, 104, 1024, 1024, 1152,
                                                                                   3072]
    sizes = {bucket_rows(n) for n in range(65, 4097)}
    assert len(sizes) <= 6 * 8 + 1 and all(n <= bucket_rows(n) <= n * 1.125 for n in range(65, 4097))
    model = tiny_model()
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    rows = torch.randn(100, 32, requires_grad=True)
    got = head_logits(model, rows)
    (got * torch.arange(64.0)).sum().backward()
    grad_rows, grad_head = rows.grad.clone(), model.lm_head.weight.grad.clone()
    rows.grad = None
    model.zero_grad()
    want = model.logits(rows)
    (want * torch.arange(64.0)).sum().backward()
    assert seen == [104, 100] and got.shape == (100, 64)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad_rows, rows.grad)
    torch.testing.assert_close(grad_head, model.lm_head.weight.grad)


@pytest.mark.parametrize("L,bs", [(8, 4), (12, 5), (32, 8), (6, 1), (7, 16)])
def test_block_mask_matches_brute_force(L, bs):
    got = block_diffusion_mask(L, bs)
    want = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    for q in range(2 * L):
        for k in range(2 * L):
            q_noisy, k_noisy = q < L, k < L
            bq, bk = (q % L) // bs, (k % L) // bs
            if q_noisy and k_noisy:
                want[q, k] = bq == bk
            elif q_noisy:
                want[q, k] = bk < bq
            elif not k_noisy:
                want[q, k] = bk <= bq
    assert torch.equal(got, want)


class _Uniform(torch.nn.Module):
    """Stub model: all-zero logits over V tokens, so every masked CE is log V."""

    def __init__(self, vocab: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(vocab, 1))

    def forward_dense(self, ids, pos, mask):
        return torch.zeros(*ids.shape, 1)

    def logits(self, h):
        return (h @ self.w.T).float()


def test_loss_hand_computation():
    obj = Objective(mask_id=3, block_sizes=(4,))
    x0 = torch.tensor([[0, 1, 2, 4, 0, 1, 2, 4]])
    masked = torch.zeros(1, 8, dtype=torch.bool)
    masked[0, 1] = masked[0, 6] = True
    p = torch.tensor([[0.5] * 4 + [0.25] * 4])
    loss = diffusion_loss_sum(_Uniform(5), x0, Noise(4, masked, p), obj)
    assert loss.item() == pytest.approx(math.log(5) * (1 / 0.5 + 1 / 0.25))  # two masked tokens, CE log 5 each

    # real model: block diffusion over [x_t ; x_0] == scoring each noisy block after the clean
    # blocks before it (what inference does), CE computed by hand from log-softmax
    model = tiny_model()
    x0 = torch.randint(16, 60, (2, 8), generator=torch.Generator().manual_seed(1))
    masked = torch.rand(2, 8, generator=torch.Generator().manual_seed(2)) < 0.5
    masked[0, 0] = masked[1, 5] = True
    p = torch.rand(2, 8, generator=torch.Generator().manual_seed(3)) * 0.9 + 0.1
    got = diffusion_loss_sum(model, x0, Noise(4, masked, p), obj)
    want = 0.0
    for b in range(2):
        for j in masked[b].nonzero().flatten().tolist():
            blk = j // 4
            xt_blk = torch.where(masked[b, blk * 4:blk * 4 + 4], 3, x0[b, blk * 4:blk * 4 + 4])
            seq = torch.cat([x0[b, :blk * 4], xt_blk])[None]
            n = seq.shape[1]
            causal = (torch.arange(n)[:, None] // 4 >= torch.arange(n)[None, :] // 4)[None, None]
            with torch.no_grad():
                lg = model.logits(model.forward_dense(seq, torch.arange(n)[None], causal))
            want += -F.log_softmax(lg[0, blk * 4 + j % 4], -1)[x0[b, j]].item() / p[b, j].item()
    assert got.item() == pytest.approx(want, rel=1e-5)

    # plain (bidirectional) form: one pass over x_t
    plain = Objective(mask_id=3)
    got = diffusion_loss_sum(model, x0, Noise(None, masked, p), plain)
    lg = logits_all(model, torch.where(masked, 3, x0))
    want = sum(-F.log_softmax(lg[b, j], -1)[x0[b, j]].item() / p[b, j].item() for b, j in masked.nonzero().tolist())
    assert got.item() == pytest.approx(want, rel=1e-5)

    # shifted logits (Dream): token j is read from row j-1; position 0 is never scored
    shifted = Objective(mask_id=3, shift=True)
    m2 = masked.clone()
    m2[:, 0] = False
    got = diffusion_loss_sum(model, x0, Noise(None, m2, p), shifted)
    lg = logits_all(model, torch.where(m2, 3, x0))
    want = sum(-F.log_softmax(lg[b, j - 1], -1)[x0[b, j]].item() / p[b, j].item() for b, j in m2.nonzero().tolist())
    assert got.item() == pytest.approx(want, rel=1e-5)
    n = draw_noise(Objective(mask_id=3, shift=True, block_sizes=(4,)), torch.ones(8, 8, dtype=torch.bool),
                   torch.Generator().manual_seed(0))
    assert not n.masked[:, 0].any()


@pytest.mark.parametrize("L,bs", [(8, 4), (12, 5), (6, 1)])
def test_causal_context_mask_matches_brute_force(L, bs):
    got = block_diffusion_mask(L, bs, causal_context=True)
    want = block_diffusion_mask(L, bs).clone()
    for q in range(L, 2 * L):  # clean rows: token-causal instead of block-causal; noisy rows unchanged
        for k in range(L, 2 * L):
            want[q, k] = k <= q
    assert torch.equal(got, want)


def test_causal_context_loss_is_what_block_by_block_decoding_reads():
    """Shifted block diffusion with a causal context: each masked token j of block b is scored from row j-1
    of [x_0 before the block, written causally ; x_t of the block, bidirectional], the sequence the engine
    runs; with next_token_weight w, plus w times the causal next-token CE of every eligible token."""
    from unmask.models.transformer import CAUSAL

    model = tiny_model()
    B, L = 4, 8
    x0 = torch.randint(16, 60, (2, L), generator=torch.Generator().manual_seed(1))
    masked = torch.rand(2, L, generator=torch.Generator().manual_seed(2)) < 0.5
    masked[:, 0] = False
    masked[0, 4] = masked[1, 5] = True  # a block's first token (read from the clean row 3) and an inner one
    p = torch.rand(2, L, generator=torch.Generator().manual_seed(3)) * 0.9 + 0.1
    obj = Objective(mask_id=3, block_sizes=(B,), shift=True, causal_context=True)
    got = diffusion_loss_sum(model, x0, Noise(B, masked, p), obj)
    want = 0.0
    for b in range(2):
        for j in masked[b].nonzero().flatten().tolist():
            start = j // B * B
            seq = torch.cat([x0[b, :start], torch.where(masked[b, start:start + B], 3, x0[b, start:start + B])])
            pos = torch.arange(seq.numel())
            ids = torch.where(pos < start, pos, start)
            with torch.no_grad():
                lg = model.logits(model.forward_dense(seq[None], pos[None], (ids[None, :] <= ids[:, None])[None, None]))
            want += -F.log_softmax(lg[0, j - 1], -1)[x0[b, j]].item() / p[b, j].item()
    assert got.item() == pytest.approx(want, rel=1e-5)

    eligible = torch.ones(2, L, dtype=torch.bool)
    eligible[:, 0] = False
    eligible[1, :3] = False  # an SFT prompt is never scored
    weighted = Objective(mask_id=3, block_sizes=(B,), shift=True, causal_context=True, next_token_weight=0.5)
    with torch.no_grad():
        lg = model.logits(model.forward_dense(x0, torch.arange(L).expand(2, L), CAUSAL))
    next_token = sum(-F.log_softmax(lg[b, j - 1], -1)[x0[b, j]].item() for b, j in eligible.nonzero().tolist())
    got = diffusion_loss_sum(model, x0, Noise(B, masked, p), weighted, eligible)
    assert got.item() == pytest.approx(want + 0.5 * next_token, rel=1e-5)
    with pytest.raises(ValueError, match="causal_context"):
        Objective(mask_id=3, block_sizes=(B,), causal_context=True)  # needs shifted logits
    with pytest.raises(ValueError, match="causal_context"):
        Objective(mask_id=3, block_sizes=(B,), shift=True, next_token_weight=1.0)


def test_suffix_masks_are_block_tails_at_the_drawn_rate():
    """suffix_fraction 1: each block masks its last ceil(p B) positions (a clean prefix before them); 0 draws
    exactly what the objective drew before the option existed; a mix gives both kinds of block."""
    lm = torch.ones(64, 32, dtype=torch.bool)
    base = Objective(mask_id=3, block_sizes=(8,), shift=True)
    tails = Objective(mask_id=3, block_sizes=(8,), shift=True, suffix_fraction=1.0)
    n = draw_noise(tails, lm, torch.Generator().manual_seed(0))
    blocks, p = n.masked.view(64, 4, 8), n.p.view(64, 4, 8)[..., 0]
    k = torch.ceil(p * 8).long()
    want = torch.arange(8)[None, None, :] >= 8 - k[..., None]
    want[:, 0, 0] = False  # shifted: position 0 has no predictor
    assert torch.equal(blocks, want)
    same = draw_noise(replace(base, suffix_fraction=0.0), lm, torch.Generator().manual_seed(0))
    assert torch.equal(same.masked, draw_noise(base, lm, torch.Generator().manual_seed(0)).masked)
    mixed = draw_noise(replace(base, suffix_fraction=0.5), lm, torch.Generator().manual_seed(1)).masked.view(-1, 8)
    is_tail = torch.tensor([torch.equal(r.int(), torch.sort(r.int())[0]) for r in mixed.unbind(0)])
    assert 0.5 < is_tail.float().mean() < 0.95  # tails, plus iid blocks that happen to be sorted
    with pytest.raises(ValueError, match="suffix_fraction"):
        Objective(mask_id=3, suffix_fraction=0.5)  # no blocks


def test_full_blocks_are_masked_whole_with_weight_one():
    """full_block_fraction 1: every eligible position masked, p = 1 (the draft block of policy speculative sees
    nothing of itself); 0 draws what the objective drew before; 0.5 masks about half the blocks whole."""
    lm = torch.ones(64, 32, dtype=torch.bool)
    base = Objective(mask_id=3, block_sizes=(8,), shift=True, causal_context=True)
    n = draw_noise(replace(base, full_block_fraction=1.0), lm, torch.Generator().manual_seed(0))
    want = torch.ones(64, 32, dtype=torch.bool)
    want[:, 0] = False  # shifted: position 0 has no predictor
    assert torch.equal(n.masked, want) and bool((n.p == 1).all())
    same = draw_noise(replace(base, full_block_fraction=0.0), lm, torch.Generator().manual_seed(0))
    assert torch.equal(same.masked, draw_noise(base, lm, torch.Generator().manual_seed(0)).masked)
    half = draw_noise(replace(base, full_block_fraction=0.5), lm, torch.Generator().manual_seed(1))
    whole = half.masked.view(64, 4, 8)[:, 1:].all(-1)
    assert 0.4 < whole.float().mean() < 0.7  # chosen blocks, plus iid blocks that happen to be all masked
    assert bool((half.p.view(64, 4, 8)[:, 1:][whole.logical_not()] < 1).all())
    with pytest.raises(ValueError, match="full_block_fraction"):
        Objective(mask_id=3, full_block_fraction=0.5)  # no blocks


def test_causal_objective_is_next_token_cross_entropy():
    """objective 'causal': every eligible token j >= 1 scored from row j-1 of a left-to-right pass, weight 1."""
    from unmask.models.transformer import CAUSAL

    model = tiny_model()
    x0 = torch.randint(16, 60, (2, 10), generator=torch.Generator().manual_seed(4))
    lm = torch.ones(2, 10, dtype=torch.bool)
    lm[1, :3] = False  # an SFT-style prompt: never scored
    obj = Objective(mask_id=3, shift=True, causal=True)
    noise = draw_noise(obj, lm, torch.Generator().manual_seed(0))
    assert noise.block_size is None and torch.equal(noise.p, torch.ones(2, 10))
    assert not noise.masked[:, 0].any() and noise.masked[0, 1:].all() and not noise.masked[1, :3].any()
    got = diffusion_loss_sum(model, x0, noise, obj)
    tril = torch.tril(torch.ones(10, 10, dtype=torch.bool))[None, None]
    with torch.no_grad():
        lg = model.logits(model.forward_dense(x0, torch.arange(10).expand(2, 10), tril))
    want = sum(-F.log_softmax(lg[b, j - 1], -1)[x0[b, j]].item() for b, j in noise.masked.nonzero().tolist())
    assert got.item() == pytest.approx(want, rel=1e-5)
    # causal: a row never sees later tokens
    x1 = x0.clone()
    x1[:, 6:] = 17
    with torch.no_grad():
        h0 = model.forward_dense(x0, torch.arange(10).expand(2, 10), CAUSAL)
        h1 = model.forward_dense(x1, torch.arange(10).expand(2, 10), CAUSAL)
    assert torch.allclose(h0[:, :6], h1[:, :6], atol=1e-6) and not torch.allclose(h0[:, 6:], h1[:, 6:])
    with pytest.raises(ValueError, match="shift"):
        Objective(mask_id=3, causal=True)
    with pytest.raises(ValueError, match="blocks"):
        Objective(mask_id=3, shift=True, causal=True, block_sizes=(4,))


def test_causal_base_then_shifted_block_diffusion(tmp_path, tokdir, corpus):
    """`train --objective causal` exports shift_logits; block diffusion continued from it reads logits
    shifted (its loss starts near the base's next-token loss, not at an untrained model's)."""
    base = train(tiny_cfg(tmp_path / "base", total_steps=30, objective="causal"), corpus, tokdir)
    assert base.losses[-1] < base.losses[0] - 1.0
    cfg = json.loads((base.model_dir / "config.json").read_text())
    assert cfg["shift_logits"] is True
    _, spec = load_model(base.model_dir, dtype="float32")
    assert spec.shift and spec.ar_first_token and spec.family.name == "unmask"
    seen = []
    cont = train(tiny_cfg(tmp_path / "adapt", total_steps=2, lr=1e-4), corpus, tokdir, init_from=base.model_dir,
                 on_step=lambda s, m: seen.append(m["block_size"]))
    assert json.loads((cont.model_dir / "config.json").read_text())["shift_logits"] is True
    fresh = train(tiny_cfg(tmp_path / "fresh", total_steps=2, lr=1e-4), corpus, tokdir)
    assert "shift_logits" not in json.loads((fresh.model_dir / "config.json").read_text())
    assert cont.losses[0] < fresh.losses[0] - 1.0, (cont.losses, fresh.losses)
    with pytest.raises(TrainConfigError, match="causal"):
        finetune(tiny_cfg(tmp_path / "ft", objective="causal"), base.model_dir, tmp_path / "none.jsonl")
    with pytest.raises(TrainConfigError, match="objective"):
        tiny_cfg(tmp_path / "x", objective="ar")

    # a causal context: recorded in the config, read by the loader, kept by fine-tuning; the next-token term
    # adds the base's own loss to the first step's (same batch, same noise: the seed is the run's)
    ctx_runs = {w: train(tiny_cfg(tmp_path / f"ctx{w}", total_steps=1, lr=1e-4, causal_context=True,
                                  next_token_weight=w), corpus, tokdir, init_from=base.model_dir)
                for w in (0.0, 1.0)}
    assert json.loads((ctx_runs[1.0].model_dir / "config.json").read_text())["causal_context"] is True
    _, spec = load_model(ctx_runs[1.0].model_dir, dtype="float32")
    assert spec.causal_context and spec.shift and spec.ar_first_token
    gap = ctx_runs[1.0].losses[0] - ctx_runs[0.0].losses[0]
    assert abs(gap - base.losses[-1]) < 0.5, (gap, base.losses)  # about the base's next-token loss
    data = tmp_path / "sft.jsonl"
    data.write_text((json.dumps(CHAT) + "\n") * 6)
    ft = finetune(tiny_cfg(tmp_path / "ctx-ft", total_steps=1, seq_len=96), ctx_runs[1.0].model_dir, data)
    assert json.loads((ft.model_dir / "config.json").read_text())["causal_context"] is True
    # the periodic eval is the diffusion loss under independent masks whatever the training noise: two runs
    # that differ only in suffix_fraction and next_token_weight (weights barely moved) report the same eval
    evals = [train(tiny_cfg(tmp_path / f"ev{i}", total_steps=1, lr=1e-9, warmup_steps=0, eval_every=1,
                            causal_context=True, **kw), corpus, tokdir, init_from=base.model_dir).eval_losses[-1][1]
             for i, kw in enumerate([dict(next_token_weight=0.0), dict(next_token_weight=1.0, suffix_fraction=1.0)])]
    assert evals[0] == pytest.approx(evals[1], rel=1e-4)
    with pytest.raises(TrainConfigError, match="shifted"):  # a fresh model has no next-token head to read
        train(tiny_cfg(tmp_path / "bad", total_steps=1, causal_context=True), corpus, tokdir)
    with pytest.raises(TrainConfigError, match="block-diffusion setting"):
        tiny_cfg(tmp_path / "bad2", objective="causal", causal_context=True)


def test_continuing_with_a_differently_numbered_tokenizer_is_refused(tmp_path, tokdir, corpus):
    base = train(tiny_cfg(tmp_path / "base", total_steps=1), corpus, tokdir)
    other = tmp_path / "tok2"
    shutil.copytree(tokdir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same tokens, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(DataError, match="numbers tokens differently"):
        train(tiny_cfg(tmp_path / "cont", total_steps=1), corpus, other, init_from=base.model_dir)
    # the source's other files travel with the export, except its training record, which describes the source
    (base.model_dir / "README.md").write_text("base card")
    (base.model_dir / "training.json").write_text('{"what": "the base"}')
    res = train(tiny_cfg(tmp_path / "cont2", total_steps=1), corpus, base.model_dir, init_from=base.model_dir)
    assert res.steps == 1
    assert (res.model_dir / "README.md").read_text() == "base card"
    assert not (res.model_dir / "training.json").exists()


def test_tied_embeddings_export(tmp_path):
    from unmask.train.checkpoint import export_model
    from unmask.train.model_init import fresh_model, new_unmask_config

    cfg = new_unmask_config(64, 32, 2, 4, 2, 8, 64, 128, 4, mask_id=3, eos_ids=[2], tie_embeddings=True)
    tm = fresh_model(cfg, {"eos_token_id": [2, 5]}, seed=0)
    assert tm.model.lm_head.weight is tm.model.model.embed_tokens.weight
    out = export_model(tm, tmp_path / "model", None)
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert "lm_head.weight" not in fh.keys()
    loaded, spec = load_model(out, dtype="float32")
    assert spec.arch.tie_embeddings and spec.stop_ids[:2] == (2, 5)
    ids = torch.randint(16, 60, (1, 12))
    assert torch.allclose(logits_all(tm.model, ids), logits_all(loaded, ids), atol=1e-6)


def test_noise_respects_loss_mask_and_blocks():
    lm = torch.ones(64, 32, dtype=torch.bool)
    lm[:, :10] = False  # an SFT prompt
    obj = Objective(mask_id=3, block_sizes=(4, 8, 16, 32))
    seen = set()
    for s in range(50):
        n = draw_noise(obj, lm, torch.Generator().manual_seed(s))
        seen.add(n.block_size)
        assert not (n.masked & ~lm).any()
        blocks = n.p.view(64, -1, n.block_size)  # one t per block
        assert torch.equal(blocks, blocks[..., :1].expand_as(blocks))
        assert n.p.min() >= 1e-3 and n.p.max() <= 1.0
    assert seen == {4, 8, 16, 32}


# ------------------------------------------------------------------ data

def test_packing_and_iterator_resume():
    rows = pack_documents([[5, 6, 7], [8, 9]], seq_len=3, sep_id=13)
    assert rows.ids.tolist() == [[5, 6, 7], [13, 8, 9]]  # the trailing separator is dropped
    a = BatchIterator(10, 4, seed=3)
    first = [next(a).tolist() for _ in range(7)]  # crosses epochs
    assert sorted(sum(first[:5], [])[:10]) == list(range(10))
    b = BatchIterator(10, 4, seed=3)
    for _ in range(4):
        next(b)
    c = BatchIterator(10, 4, seed=3)
    c.load_state_dict(b.state_dict())
    assert [next(c).tolist() for _ in range(3)] == first[4:]


# ------------------------------------------------------------------ training

def test_training_reduces_loss_and_exports(tmp_path, tokdir, corpus):
    cfg = tiny_cfg(tmp_path / "run", total_steps=40, warmup_steps=4, batch_size=8, eval_every=20, eval_batches=1,
                   bf16=True, progress="plain")
    res = train(cfg, corpus, tokdir)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < first - 0.5, res.losses
    assert [s for s, _ in res.eval_losses] == [20, 40] and res.eval_losses[1][1] < res.eval_losses[0][1]

    loaded, spec = load_model(res.model_dir, dtype="float32")
    assert spec.family.name == "unmask" and spec.mask_id == 3 and spec.block_size == 4
    assert {2, 5, 13} <= set(spec.stop_ids)
    assert (res.model_dir / "tokenizer.json").is_file() and (res.model_dir / "generation_config.json").is_file()
    ids = torch.randint(16, 60, (2, 16))
    assert torch.allclose(logits_all(res.model.float(), ids), logits_all(loaded, ids), atol=1e-6)


class _Kill(Exception):
    pass


def test_resume_is_bit_exact(tmp_path, tokdir, corpus):
    full = train(tiny_cfg(tmp_path / "a", total_steps=8), corpus, tokdir)

    def kill_at_5(step, metrics):
        if step == 5:
            raise _Kill  # dies after the step-3 checkpoint, with 2 unsaved steps
    with pytest.raises(_Kill):
        train(tiny_cfg(tmp_path / "b", total_steps=8, save_every=3), corpus, tokdir, on_step=kill_at_5)
    resumed_steps = []
    res = train(tiny_cfg(tmp_path / "b", total_steps=8, save_every=3, resume=True), corpus, tokdir,
                on_step=lambda s, m: resumed_steps.append(s))
    assert resumed_steps == [4, 5, 6, 7, 8]
    assert res.losses == full.losses  # bit for bit
    for (n, a), (_, b) in zip(full.model.state_dict().items(), res.model.state_dict().items()):
        assert torch.equal(a, b), n

    with pytest.raises(CheckpointError, match="seq_len"):
        train(tiny_cfg(tmp_path / "b", total_steps=8, seq_len=16, resume=True), corpus, tokdir)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_blocks_train_like_eager_and_export_the_same_names(tmp_path, tokdir, corpus):
    """--compile: the same losses (float32, up to fused-kernel rounding) and a checkpoint/export whose
    parameter names are the eager model's (nn.Module.compile keeps them; torch.compile(m) would not)."""
    eager = train(tiny_cfg(tmp_path / "a", total_steps=3), corpus, tokdir)
    comp = train(tiny_cfg(tmp_path / "b", total_steps=3, compile=True), corpus, tokdir)
    assert comp.losses == pytest.approx(eager.losses, rel=1e-4)
    assert list(comp.model.state_dict()) == list(eager.model.state_dict())
    with safe_open(str(comp.model_dir / "model.safetensors"), "pt") as f, \
            safe_open(str(eager.model_dir / "model.safetensors"), "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())


def test_checkpointed_activations_train_like_the_plain_run(tmp_path, tokdir, corpus):
    """--checkpoint-activations recomputes each block in the backward: the same losses (float32, to rounding),
    the same exported names; with --compile on top, the same again."""
    plain = train(tiny_cfg(tmp_path / "a", total_steps=3), corpus, tokdir)
    ckpt = train(tiny_cfg(tmp_path / "b", total_steps=3, checkpoint_activations=True), corpus, tokdir)
    assert ckpt.losses == pytest.approx(plain.losses, rel=1e-5)
    assert list(ckpt.model.state_dict()) == list(plain.model.state_dict())
    blocks = ckpt.model.model.layers
    assert all(isinstance(b.forward, functools.partial) for b in blocks)   # the recomputing wrapper is in place
    if shutil.which("g++") or shutil.which("c++"):
        both = train(tiny_cfg(tmp_path / "c", total_steps=3, checkpoint_activations=True, compile=True), corpus,
                     tokdir)
        assert both.losses == pytest.approx(plain.losses, rel=1e-4)


def test_checkpointed_blocks_run_their_forward_again_in_the_backward():
    """What saves the memory: with gradients each block's forward runs twice a step (the pass, then the recompute
    in the backward), without gradients once; the gradients are the plain model's."""
    from unmask.models.transformer import CAUSAL, ArchConfig
    from unmask.train.trainer import checkpoint_blocks

    torch.manual_seed(0)
    cfg = ArchConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_position=64)
    plain, ckpt = DiffusionTransformer(cfg), DiffusionTransformer(cfg)
    ckpt.load_state_dict(plain.state_dict())
    calls = [0] * cfg.num_layers
    for i, block in enumerate(ckpt.model.layers):
        def counted(*args, _forward=block.forward, _i=i):
            calls[_i] += 1
            return _forward(*args)
        block.forward = counted
    assert checkpoint_blocks(ckpt) == cfg.num_layers
    ids = torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    for model in (plain, ckpt):
        model.logits(model.forward_dense(ids, pos, CAUSAL)).sum().backward()
    assert calls == [2] * cfg.num_layers
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    with torch.no_grad():
        ckpt.forward_dense(ids, pos, CAUSAL)
    assert calls == [3] * cfg.num_layers


def test_grad_accum_matches_one_batch(tmp_path, tokdir, corpus):
    one = train(tiny_cfg(tmp_path / "a", total_steps=2), corpus, tokdir)
    acc = train(tiny_cfg(tmp_path / "b", total_steps=2, grad_accum=2), corpus, tokdir)
    assert acc.losses == pytest.approx(one.losses, abs=1e-6)


def join_ddp(rank: int, world: int, port: int) -> None:
    """In a spawned worker: the environment torchrun would give rank `rank` of `world` on loopback."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def spawn_ddp(worker, out: Path, *args) -> list[list[float]]:
    """Run `worker(rank, 2, port, out, *args)` in two processes; each writes out/losses{rank}.json."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, str(out), *args), nprocs=2, join=True)
    return [json.loads((out / f"losses{r}.json").read_text()) for r in range(2)]


def _ddp_worker(rank: int, world: int, port: int, out: str, tokdir: str, corpus: str) -> None:
    join_ddp(rank, world, port)
    res = train(tiny_cfg(Path(out), total_steps=2), corpus, tokdir)
    Path(out, f"losses{rank}.json").write_text(json.dumps(res.losses))


def test_ddp_two_processes_match_one(tmp_path, tokdir, corpus):
    single = train(tiny_cfg(tmp_path / "one", total_steps=2), corpus, tokdir)
    out = tmp_path / "ddp"
    for losses in spawn_ddp(_ddp_worker, out, str(tokdir), str(corpus)):
        assert losses == pytest.approx(single.losses, abs=1e-6)  # step 2 runs on updated weights
    assert (out / "model" / "model.safetensors").is_file()


def test_unwritable_out_dir_fails_first(tmp_path, tokdir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="not writable"):
        train(tiny_cfg(blocker / "run"), tmp_path / "no-such-corpus", tokdir)


# ------------------------------------------------------------------ SFT

CHAT = {"messages": [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi?"},
                     {"role": "assistant", "content": "hello."}, {"role": "user", "content": "and?"},
                     {"role": "assistant", "content": "bye."}]}
FIM = {"fim": {"prefix": "def f(", "suffix": "):\n", "middle": "x"}}


def _encoder(tokdir):
    from unmask.tokenizer import Tokenizer
    return SFTEncoder(Tokenizer(tokdir), eos_id=2, stop_ids=(2, 5))


def test_sft_loss_only_on_answers(tmp_path, tokdir):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps(FIM) + "\n")
    enc = _encoder(tokdir)
    rows, report = load_sft(path, enc, seq_len=96)
    assert report.records == 2 and rows.ids.shape == (2, 96)
    tok = enc.tok
    ids, lm = rows.ids[0].tolist(), rows.loss_mask[0].tolist()
    learned = tok.decode([i for i, m in zip(ids, lm) if m], skip_special_tokens=False)
    n_text = len(tok.encode(tok.apply_chat_template(CHAT["messages"], add_generation_prompt=False).rstrip("\n")))
    assert learned.startswith("hello.<|im_end|>bye.<|im_end|><|eos|>")
    assert all(lm[n_text:]) and ids[n_text:] == [2] * (96 - n_text)  # EOS padding is learned
    prompt = tok.decode([i for i, m in zip(ids[:n_text], lm[:n_text]) if not m], skip_special_tokens=False)
    assert "be brief." in prompt and "<|im_start|>assistant\n" in prompt and "hello" not in prompt
    fim_ids, fim_lm = rows.ids[1].tolist(), rows.loss_mask[1].tolist()
    assert fim_ids[:1] == [6] and tok.decode([i for i, m in zip(fim_ids, fim_lm) if m][:2], False) == "x<|eos|>"
    assert not any(fim_lm[:fim_ids.index(8) + 1])

    obj = Objective(mask_id=3, block_sizes=(4, 8))
    for s in range(20):  # prompt tokens are never noised, hence never scored
        n = draw_noise(obj, rows.loss_mask, torch.Generator().manual_seed(s))
        assert not (n.masked & ~rows.loss_mask).any()


def test_malformed_jsonl_lines_are_reported(tmp_path, tokdir):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([json.dumps(CHAT), "{not json", json.dumps(FIM), json.dumps({"messages": []}), ""]))
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        read_jsonl(path, on_error="raise")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        records, report = read_jsonl(path, on_error="skip")
    assert [n for n, _ in records] == [1, 3] and [n for n, _ in report.skipped] == [2, 4]
    assert any("skipped 2 malformed line(s): 2, 4" in str(x.message) for x in w)


# ------------------------------------------------------------------ public-family fine-tuning

def _tiny_family_checkpoint(d: Path, config: dict, tokdir: Path) -> dict[str, torch.Tensor]:
    d.mkdir(parents=True)
    fam = family_for(config)
    arch = fam.parse_config(config)
    m = DiffusionTransformer(arch)
    init_weights(m, 5)
    state = fam.from_canonical(dict(m.state_dict()), arch)
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config))
    for f in tokdir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return state


SDAR_CFG = {"architectures": ["SDARForCausalLM"], "model_type": "sdar", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "block_size": 4,
            "mask_token_id": 63, "bos_token_id": 2, "eos_token_id": 2, "torch_dtype": "float32"}
LLADA_CFG = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 32, "n_layers": 2, "n_heads": 4,
             "n_kv_heads": 4, "mlp_hidden_size": 64, "vocab_size": 64, "embedding_size": 64,
             "max_sequence_length": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "weight_tying": False,
             "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "mask_token_id": 63,
             "eos_token_id": 2, "pad_token_id": 2}


def _sdar_and_chat(tmp_path: Path, tokdir: Path) -> tuple[Path, Path]:
    """A tiny SDAR checkpoint (tmp_path/src) and four copies of the CHAT record (tmp_path/sft.jsonl)."""
    src, data = tmp_path / "src", tmp_path / "sft.jsonl"
    _tiny_family_checkpoint(src, SDAR_CFG, tokdir)
    data.write_text((json.dumps(CHAT) + "\n") * 4)
    return src, data


@pytest.mark.parametrize("config,probe", [(SDAR_CFG, "model.layers.0.self_attn.q_norm.weight"),
                                          (LLADA_CFG, "model.transformer.blocks.0.ff_proj.weight")])
def test_finetune_public_family_keeps_its_format(tmp_path, tokdir, config, probe):
    src = tmp_path / "src"
    before = _tiny_family_checkpoint(src, config, tokdir)
    data = tmp_path / "sft.jsonl"
    data.write_text((json.dumps(CHAT) + "\n" + json.dumps(FIM) + "\n") * 4)
    res = finetune(tiny_cfg(tmp_path / "run", total_steps=3, seq_len=96, block_sizes=None), src, data)
    with safe_open(str(res.model_dir / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        assert names == set(before) and probe in names
        assert not torch.equal(fh.get_tensor(probe), before[probe])  # trained
    assert json.loads((res.model_dir / "config.json").read_text())["architectures"] == config["architectures"]
    loaded, spec = load_model(res.model_dir, dtype="float32")
    assert spec.family.name == family_for(config).name and spec.mask_id == 63
    ids = torch.randint(16, 60, (2, 16))
    assert torch.allclose(logits_all(res.model, ids), logits_all(loaded, ids), atol=1e-6)


def test_lora_finetune_trains_adapters_and_merges(tmp_path, tokdir, monkeypatch):
    before = _tiny_family_checkpoint(tmp_path / "src", SDAR_CFG, tokdir)
    monkeypatch.chdir(tmp_path)
    src = Path("src")  # relative, as typed on a command line
    data = tmp_path / "sft.jsonl"
    data.write_text((json.dumps(CHAT) + "\n") * 4)
    res = finetune(tiny_cfg(tmp_path / "run", total_steps=3, seq_len=96, lora_rank=4, lr=5e-2), src, data)
    trained = {n for n, p in res.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert (res.out_dir / "adapter" / "adapter_model.safetensors").is_file()
    # the adapter names its base so that it can be found from any working directory
    adapter_cfg = json.loads((res.out_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(tmp_path / "src") and adapter_cfg["r"] == 4
    # the weights are as readable as the json beside them (safetensors itself creates files 0600), so another
    # account (a server's) can load what the training account exported
    for d, weights, meta in (("model", "model.safetensors", "config.json"),
                             ("adapter", "adapter_model.safetensors", "adapter_config.json")):
        assert (res.out_dir / d / weights).stat().st_mode == (res.out_dir / d / meta).stat().st_mode
    loaded, _ = load_model(res.model_dir, dtype="float32")
    ids = torch.randint(16, 60, (2, 16))
    assert torch.allclose(logits_all(res.model, ids), logits_all(loaded, ids), atol=1e-5)
    with safe_open(str(res.model_dir / "model.safetensors"), "pt") as fh:  # deltas merged into q_proj
        key = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(fh.get_tensor(key), before[key])
        assert torch.equal(fh.get_tensor("model.norm.weight"), before["model.norm.weight"])  # frozen


def test_sft_packing_fills_rows_and_keeps_each_answer_terminated():
    from unmask.train.sft import build_sft_rows

    class Enc:
        eos_id = 2

        def encode(self, rec):
            n = rec["n"]
            return [7] * n + [5], [False] * n + [True]  # prompt, then a stop token in the loss

    recs = [(i + 1, {"n": n}) for i, n in enumerate([3, 4, 10, 2])]
    one_per_row = build_sft_rows(recs, Enc(), seq_len=12, path="x")
    packed = build_sft_rows(recs, Enc(), seq_len=12, path="x", pack=True)
    assert one_per_row.ids.shape[0] == 4
    assert packed.ids.shape[0] == 3  # rows: [4 + 5 tokens], [11], [3]
    row0 = packed.ids[0].tolist()
    assert row0[:9] == [7, 7, 7, 5, 7, 7, 7, 7, 5] and row0[9:] == [2, 2, 2]
    assert packed.loss_mask[0].tolist() == [False] * 3 + [True] + [False] * 4 + [True] + [True] * 3


def test_mix_rows_adds_text_rows_at_the_asked_share():
    from unmask.train.data import TokenRows
    from unmask.train.data import mix_rows

    sft = TokenRows(torch.zeros(6, 8, dtype=torch.int32), torch.tensor([[False] * 4 + [True] * 4] * 6))
    text = TokenRows(torch.arange(40, dtype=torch.int32).view(5, 8) + 100)
    mixed = mix_rows(sft, text, 0.25, seed=0)  # 6 SFT rows -> 2 text rows is a quarter
    assert mixed.ids.shape == (8, 8)
    assert torch.equal(mixed.ids[:6], sft.ids) and torch.equal(mixed.loss_mask[:6], sft.loss_mask)
    assert mixed.loss_mask[6:].all()
    starts = sorted(int(r[0]) for r in mixed.ids[6:])
    assert len(set(starts)) == 2 and all((s - 100) % 8 == 0 for s in starts)  # whole distinct text rows
    assert torch.equal(mix_rows(sft, text, 0.25, seed=0).ids, mixed.ids)  # seeded
    assert len(mix_rows(sft, text, 0.9, seed=0)) == 6 + 5  # capped by the text available


def test_finetune_with_text_mix_trains_on_both(tmp_path, tokdir, corpus):
    src = tmp_path / "src"
    _tiny_family_checkpoint(src, SDAR_CFG, tokdir)
    data = tmp_path / "sft.jsonl"
    data.write_text((json.dumps(CHAT) + "\n") * 6)
    res = finetune(tiny_cfg(tmp_path / "run", total_steps=2, seq_len=96, block_sizes=None, mix_fraction=0.5), src,
                   data, mix_text=corpus)
    assert res.steps == 2 and all(math.isfinite(x) for x in res.losses)
    assert any((res.out_dir / "tokens").iterdir())  # the corpus was tokenized for the mix
    with pytest.raises(Exception, match="mix_fraction must be in"):
        tiny_cfg(tmp_path / "bad", mix_fraction=1.0)


# ------------------------------------------------------------------ precision

def test_bf16_default_follows_native_support(monkeypatch):
    import unmask.train.precision as precision

    for avx512_bf16, amx, expect in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert precision.bf16_is_fast("cpu") is expect
        assert precision.use_bf16(None, "cpu") is expect
        assert precision.use_bf16(True, "cpu") is True and precision.use_bf16(False, "cpu") is False
    assert precision.bf16_is_fast("meta") is False


@pytest.mark.parametrize("native", [False, True])
def test_trainer_reports_the_precision_it_chose(tmp_path, tokdir, corpus, capsys, monkeypatch, native):
    import unmask.train.precision as precision

    monkeypatch.setattr(precision, "bf16_is_fast", lambda device: native)
    train(tiny_cfg(tmp_path / "run", total_steps=1, bf16=None, progress="plain"), corpus, tokdir)
    out = capsys.readouterr().out
    assert ("bf16 autocast" in out) is native and ("float32" in out) is (not native), out


# ------------------------------------------------------------------ bad input and data loss

def _cli(*args):
    from typer.testing import CliRunner
    from unmask.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_error(r, *fragments):
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


TINY_FLAGS = ("--hidden", 32, "--layers", 2, "--heads", 4, "--kv-heads", 2, "--head-dim", 8, "--intermediate", 64,
              "--seq-len", 32, "--batch-size", 4, "--steps", 2, "--warmup", 0, "--eval-every", 0, "--no-bf16")


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_rerun_into_an_earlier_run_needs_resume_or_overwrite(tmp_path, tokdir, corpus):
    out = tmp_path / "run"
    train(tiny_cfg(out, total_steps=2), corpus, tokdir)
    before = _files(out)
    assert "checkpoint.pt" in before and "model/model.safetensors" in before
    r = _cli("train", "--data", corpus, "--tokenizer", tokdir, "--out", out, *TINY_FLAGS)
    _one_line_error(r, "already holds checkpoint.pt and model/", "--resume", "--overwrite")
    assert _files(out) == before  # nothing replaced, not even the token cache
    with pytest.raises(CheckpointError, match="already holds"):
        train(tiny_cfg(out, total_steps=2), corpus, tokdir)
    _one_line_error(_cli("train", "--data", corpus, "--tokenizer", tokdir, "--out", out, "--resume", "--overwrite",
                         *TINY_FLAGS), "choose one")
    assert _files(out) == before

    r = _cli("train", "--data", corpus, "--tokenizer", tokdir, "--out", out, "--overwrite", "--seed", 1, *TINY_FLAGS)
    assert r.exit_code == 0, r.output
    after = _files(out)
    assert after["checkpoint.pt"] != before["checkpoint.pt"]
    assert after["model/model.safetensors"] != before["model/model.safetensors"]

    # a model/ without a checkpoint cannot be resumed, so --resume alone would replace it: refused too
    (out / "checkpoint.pt").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint.pt to resume"):
        train(tiny_cfg(out, total_steps=2, resume=True), corpus, tokdir)
    assert (out / "model" / "model.safetensors").read_bytes() == after["model/model.safetensors"]


def test_a_diverging_run_stops_before_it_saves(tmp_path, tokdir, corpus, monkeypatch):
    from unmask.train import trainer

    out = tmp_path / "run"
    train(tiny_cfg(out, total_steps=2), corpus, tokdir)
    before = _files(out)
    seen = []
    with pytest.raises(TrainDivergedError, match=r"diverged at step 2: the gradient norm is nan"):
        train(tiny_cfg(out, lr=1e30, overwrite=True), corpus, tokdir, on_step=lambda s, m: seen.append(s))
    assert seen == [1] and _files(out) == before  # stopped at once; the earlier run's files are intact
    with pytest.raises(TrainDivergedError, match="the training loss is nan"):  # no clipping: the loss shows it
        train(tiny_cfg(out, lr=1e30, grad_clip=0.0, overwrite=True), corpus, tokdir)
    with pytest.raises(TrainDivergedError, match="step overflows float32"):  # lr 1e39 is inf in float32
        train(tiny_cfg(out, lr=1e39, overwrite=True), corpus, tokdir)
    assert _files(out) == before

    # weights that overflow in the last step, after a finite loss and gradient: caught before the save
    real_step = trainer._train_step

    def poisoned(cfg, ctx, loss_module, *a):
        loss = real_step(cfg, ctx, loss_module, *a)
        with torch.no_grad():
            loss_module.model.lm_head.weight[0, 0] = float("inf")
        return loss
    monkeypatch.setattr(trainer, "_train_step", poisoned)
    with pytest.raises(TrainDivergedError, match=r"step 1: weight lm_head.weight is not finite"):
        train(tiny_cfg(out, total_steps=1, overwrite=True), corpus, tokdir)
    assert _files(out) == before
    for lr in ("inf", "nan", "0"):
        r = _cli("train", "--data", corpus, "--tokenizer", tokdir, "--out", tmp_path / f"lr{lr}", "--lr", lr,
                 *TINY_FLAGS)
        _one_line_error(r, "lr must be a finite number > 0")
        assert not (tmp_path / f"lr{lr}").exists()


def test_on_error_is_validated_and_undecodable_lines_are_malformed(tmp_path, tokdir):
    data = tmp_path / "sft.jsonl"
    data.write_bytes(json.dumps(CHAT).encode() + b"\n" + b'{"messages": [{"role": "user", "content": "caf\xe9"}, '
                     b'{"role": "assistant", "content": "ok"}]}\n' + json.dumps(FIM).encode() + b"\n")
    for bad in ("bogus", "RAISE"):
        r = _cli("finetune", "-m", tmp_path / "no-model", "--data", data, "--out", tmp_path / "out",
                 "--on-error", bad)
        _one_line_error(r, "on_error must be one of raise, skip", repr(bad))
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match=r"sft\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 47\)"):
        read_jsonl(data, on_error="raise")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        records, report = read_jsonl(data, on_error="skip")
    assert [n for n, _ in records] == [1, 3] and [n for n, _ in report.skipped] == [2]
    assert all("\ufffd" not in json.dumps(rec) for _, rec in records)


@pytest.mark.parametrize("flags,message", [
    (("--block-sizes", "abc"), "--block-sizes must be comma-separated positive integers, got 'abc'"),
    (("--block-sizes", ","), "--block-sizes must be comma-separated positive integers"),
    (("--block-sizes", "0"), "--block-sizes must be comma-separated positive integers, got '0'"),
    (("--block-sizes", "4,-4"), "--block-sizes must be comma-separated positive integers, got '4,-4'"),
    (("--heads", "2", "--kv-heads", "3"), "heads 2 must be a multiple of kv_heads 3"),
    (("--layers", "0"), "layers must be a positive integer, got 0"),
    (("--heads", "0"), "heads must be a positive integer, got 0"),
    (("--head-dim", "15"), "head_dim must be even"),
    (("--hidden", "0"), "hidden must be a positive integer, got 0"),
    (("--eval-every", "-1"), "eval_every must be >= 0, got -1"),
    (("--save-every", "-5"), "save_every must be >= 0, got -5"),
])
def test_bad_train_flags_are_one_line_errors_before_any_work(tmp_path, tokdir, flags, message):
    out = tmp_path / "run"
    # the data does not exist: a check made after reading it would report that instead
    r = _cli("train", "--data", tmp_path / "no-corpus", "--tokenizer", tokdir, "--out", out, *TINY_FLAGS, *flags)
    _one_line_error(r, message)
    assert not out.exists()


def test_bad_finetune_flags_are_one_line_errors(tmp_path):
    for flags, message in ((("--lora-rank", "-1"), "lora_rank must be >= 0, got -1"),
                           (("--block-sizes", "x,4"), "--block-sizes must be comma-separated positive integers")):
        r = _cli("finetune", "-m", tmp_path / "no-model", "--data", tmp_path / "x.jsonl", "--out", tmp_path / "out",
                 *flags)
        _one_line_error(r, message)
    with pytest.raises(TrainConfigError, match="kv_heads"):
        ModelShape(heads=4, kv_heads=3)


def test_finetune_resume_compares_the_model_being_finetuned(tmp_path, tokdir):
    src, data = _sdar_and_chat(tmp_path, tokdir)
    out = tmp_path / "run"
    ft = ("--data", data, "--out", out, "--seq-len", 96, "--batch-size", 4, "--warmup", 0, "--eval-every", 0,
          "--no-bf16")
    assert _cli("finetune", "-m", src, *ft, "--steps", 2).exit_code == 0
    # resuming a fine-tune of an SDAR model is checked against that model, not the default fresh-model shape
    r = _cli("finetune", "-m", src, *ft, "--steps", 3, "--resume")
    assert r.exit_code == 0, r.output
    assert "resumed at step 2" in r.stdout and "done: 3 steps" in r.stdout
    before = _files(out)
    other = tmp_path / "other"
    _tiny_family_checkpoint(other, dict(SDAR_CFG, hidden_size=48), tokdir)
    r = _cli("finetune", "-m", other, *ft, "--steps", 4, "--resume")
    _one_line_error(r, "cannot resume: the checkpoint is of another model shape (hidden_size was 32, now 48)")
    assert _files(out) == before


def _fail_after_writing(*args, **kwargs):
    fh = args[1] if len(args) > 1 else None
    if hasattr(fh, "write"):
        fh.write(b"partial")  # some bytes reach the temp file before the disk fills
    raise OSError(28, "No space left on device")


def test_disk_full_while_saving_leaves_the_old_files_and_no_temp_files(tmp_path, tokdir, corpus, monkeypatch):
    import unmask.train.checkpoint as ckpt

    out = tmp_path / "run"
    train(tiny_cfg(out, total_steps=2), corpus, tokdir)
    before = _files(out)

    def junk():
        return sorted(p.name for p in out.iterdir() if p.name.startswith("."))

    with monkeypatch.context() as m:
        m.setattr(ckpt.torch, "save", _fail_after_writing)
        with pytest.raises(CheckpointError, match=r"cannot write .*checkpoint\.pt: No space left on device"):
            train(tiny_cfg(out, total_steps=2, overwrite=True), corpus, tokdir)
        assert junk() == [] and _files(out) == before
        r = _cli("train", "--data", corpus, "--tokenizer", tokdir, "--out", out, "--overwrite", *TINY_FLAGS)
        _one_line_error(r, "checkpoint.pt: No space left on device")
        assert junk() == [] and _files(out) == before

    with monkeypatch.context() as m:  # the export: the old model/ stays whole, no .model.tmp<pid>/ remains
        m.setattr(ckpt, "save_file", lambda *a, **k: _fail_after_writing())
        with pytest.raises(CheckpointError, match=r"cannot write .*model: No space left on device"):
            train(tiny_cfg(out, total_steps=2, overwrite=True, seed=3), corpus, tokdir)
        assert junk() == []
        assert {k: v for k, v in _files(out).items() if k.startswith("model/")} == \
            {k: v for k, v in before.items() if k.startswith("model/")}


def test_a_failed_start_removes_the_out_dir_it_created(tmp_path, tokdir, corpus):
    r = _cli("train", "--data", tmp_path / "no-corpus", "--tokenizer", tokdir, "--out", tmp_path / "new" / "run",
             *TINY_FLAGS)
    _one_line_error(r, "not found")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    r = _cli("train", "--data", tmp_path / "no-corpus", "--tokenizer", tokdir, "--out", kept, *TINY_FLAGS)
    assert r.exit_code == 1 and kept.is_dir()  # a folder the user made stays
    # a failure after tokenizing (a fresh model has no shifted logits for a causal context) takes the token
    # cache with the folder the run made
    with pytest.raises(TrainConfigError, match="shifted"):
        train(tiny_cfg(tmp_path / "late", causal_context=True), corpus, tokdir)
    assert not (tmp_path / "late").exists()


def test_resume_with_a_new_lr_trains_at_that_lr(tmp_path, tokdir, corpus):
    """The divergence message says to lower the lr: a resumed run must use the lr it is given, not the
    checkpoint's (the optimizer's and scheduler's saved state used to keep the old one)."""
    from unmask.train.trainer import lr_lambda

    out = tmp_path / "run"
    train(tiny_cfg(out, total_steps=2, lr=1e-2), corpus, tokdir)
    seen = {}
    cfg = tiny_cfg(out, total_steps=4, lr=1e-4, resume=True)
    train(cfg, corpus, tokdir, on_step=lambda s, m: seen.setdefault(s, m["lr"]))
    assert sorted(seen) == [3, 4]
    assert seen[3] == pytest.approx(1e-4 * lr_lambda(cfg)(3), rel=1e-9)
    assert seen[4] == pytest.approx(1e-4 * lr_lambda(cfg)(4), rel=1e-9)


def test_resume_follows_this_runs_weight_decay_and_betas(tmp_path, tokdir, corpus, monkeypatch):
    """Like the lr: the optimizer's hyper-parameters on resume are this run's, not the checkpoint's."""
    from unmask.train import trainer as T

    out = tmp_path / "run"
    train(tiny_cfg(out, total_steps=2, weight_decay=0.1, betas=(0.9, 0.95)), corpus, tokdir)
    groups = []
    real = T._optimizer
    monkeypatch.setattr(T, "_optimizer", lambda model, cfg: groups.append(real(model, cfg)) or groups[-1])
    train(tiny_cfg(out, total_steps=3, weight_decay=0.0, betas=(0.8, 0.9), resume=True), corpus, tokdir)
    assert [(g["weight_decay"], tuple(g["betas"])) for g in groups[0].param_groups] == [(0.0, (0.8, 0.9))] * 2


def test_finetune_of_an_inference_only_family_is_one_line(tmp_path):
    src = tmp_path / "dgemma"
    src.mkdir()
    text = {"head_dim": 16, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "top_k_experts": 2,
            "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
            "vocab_size": 512, "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True}
    (src / "config.json").write_text(json.dumps({"architectures": ["DiffusionGemmaForBlockDiffusion"],
                                                 "model_type": "diffusion_gemma", "canvas_length": 8,
                                                 "text_config": text}))
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(CHAT) + "\n")
    for extra in ((), ("--lora-rank", "4")):
        r = _cli("finetune", "-m", src, "--data", data, "--out", tmp_path / "out", *extra)
        _one_line_error(r, "diffusion_gemma", "cannot be trained")
        assert not (tmp_path / "out").exists()


def test_sft_data_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(DataError, match="is a directory, not a JSONL file"):
        read_jsonl(tmp_path)
    with pytest.raises(DataError, match="not found"):
        read_jsonl(tmp_path / "none.jsonl")


def test_overwrite_leaves_no_file_of_the_earlier_run(tmp_path, tokdir):
    """--overwrite of a LoRA run by a full fine-tune: the old adapter/ must not stay beside the new model/."""
    src, data = _sdar_and_chat(tmp_path, tokdir)
    out = tmp_path / "run"
    finetune(tiny_cfg(out, total_steps=1, seq_len=96, lora_rank=2), src, data)
    assert (out / "adapter").is_dir()
    res = finetune(tiny_cfg(out, total_steps=1, seq_len=96, overwrite=True), src, data)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "model"] and res.model_dir == out / "model"
    # and an unmerged LoRA run over a full one drops the old model/, which the adapter does not describe
    res = finetune(tiny_cfg(out, total_steps=1, seq_len=96, lora_rank=2, lora_merge=False, overwrite=True), src, data)
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "checkpoint.pt"] and res.model_dir is None


def test_a_run_clears_what_killed_runs_left_mid_write(tmp_path, tokdir, corpus):
    """A kill while checkpoint.pt or model/ is being written leaves its temp file or folder (named by that
    process's pid); killing and resuming again and again must not pile them up (each one a checkpoint's size)."""
    out = tmp_path / "run"
    train(tiny_cfg(out, total_steps=2, save_every=1), corpus, tokdir)
    (out / ".checkpoint.pt.tmp999991").write_bytes(b"x" * 100)
    for d in (".model.tmp999991", ".model.old999992", ".adapter.tmp999993"):
        (out / d).mkdir()
        (out / d / "model.safetensors").write_bytes(b"x")
    (out / "notes.txt").write_text("mine")
    train(tiny_cfg(out, total_steps=3, save_every=1, resume=True), corpus, tokdir)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "model", "notes.txt", "tokens"]
    # killed between the two renames of an export: model/ is only in its .old copy, which is put back
    from unmask.train.checkpoint import clear_leftovers

    os.replace(out / "model", out / ".model.old999994")
    (out / ".model.tmp999995").mkdir()
    assert sorted(clear_leftovers(out)) == [".model.tmp999995"]
    assert (out / "model" / "model.safetensors").is_file() and not list(out.glob(".model.*"))


def test_cli_warnings_are_one_plain_line(tmp_path, tokdir):
    """Skipped records are reported as `warning: …` lines, not Python's warning format with a source line."""
    src = tmp_path / "src"
    _tiny_family_checkpoint(src, SDAR_CFG, tokdir)
    data = tmp_path / "sft.jsonl"
    long = {"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]}
    data.write_text((json.dumps(CHAT) + "\n") * 3 + json.dumps(long) + "\n{oops\n")
    r = _cli("finetune", "-m", src, "--data", data, "--out", tmp_path / "run", "--seq-len", 96, "--batch-size", 2,
             "--steps", 1, "--warmup", 0, "--eval-every", 0, "--no-bf16", "--on-error", "skip")
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if line.strip()]
    assert warned == [f"warning: {data}: skipped 1 malformed line(s): 5 (line 5: invalid JSON (Expecting property "
                      "name enclosed in double quotes at column 2))",
                      f"warning: {data}: skipped 1 record(s) longer than seq_len 96"], r.stderr


def test_rows_longer_than_the_context_warn_or_widen_it(tmp_path, tokdir, corpus):
    """Fine-tuning past a checkpoint's context is allowed with a warning (serving still stops there); a fresh
    model's context is widened to the rows it trains on."""
    src, data = _sdar_and_chat(tmp_path, tokdir)  # max_position_embeddings 128
    with pytest.warns(UserWarning, match="seq_len 160 is longer than the model's context .*128"):
        finetune(tiny_cfg(tmp_path / "ft", total_steps=1, seq_len=160), src, data)
    res = train(tiny_cfg(tmp_path / "fresh", total_steps=1, seq_len=64, model=dataclasses.replace(TINY, max_position=32)),
                corpus, tokdir)
    assert json.loads((res.model_dir / "config.json").read_text())["max_position_embeddings"] == 64


def test_resume_takes_the_default_block_sizes_spelled_out(tmp_path, tokdir):
    """Fine-tuning at the model's own block sizes (the default), then resuming with them named: the same run."""
    src, data = _sdar_and_chat(tmp_path, tokdir)  # block_size 4
    out = tmp_path / "run"
    finetune(tiny_cfg(out, total_steps=1, seq_len=96, block_sizes=None), src, data)
    res = finetune(tiny_cfg(out, total_steps=2, seq_len=96, block_sizes=(4,), resume=True), src, data)
    assert res.steps == 2
    with pytest.raises(CheckpointError, match=r"block_sizes was \(4,\), now \(8,\)"):
        finetune(tiny_cfg(out, total_steps=3, seq_len=96, block_sizes=(8,), resume=True), src, data)


def test_parameter_counts_read_as_millions_or_plain():
    from unmask.train.trainer import _millions

    assert (_millions(5_250_000), _millions(10_000), _millions(4_356)) == ("5.25M", "0.01M", "4,356")


def test_lora_resume_refuses_another_base_of_the_same_shape(tmp_path, tokdir):
    src, data = _sdar_and_chat(tmp_path, tokdir)
    other = tmp_path / "other"  # the same shape, other weights
    state = _tiny_family_checkpoint(other, SDAR_CFG, tokdir)
    save_file({k: (v + 0.01).contiguous() for k, v in state.items()}, str(other / "model.safetensors"))
    out = tmp_path / "run"
    finetune(tiny_cfg(out, total_steps=1, seq_len=96, lora_rank=2, save_every=1), src, data)
    assert finetune(tiny_cfg(out, total_steps=2, seq_len=96, lora_rank=2, resume=True), src, data).steps == 2
    with pytest.raises(CheckpointError, match="frozen weights differ from the checkpoint's"):
        finetune(tiny_cfg(out, total_steps=3, seq_len=96, lora_rank=2, resume=True), other, data)
