"""The corruption objective (issue 35 item 2, src/unmask/train/corruption.py): a share of the noised positions hold a
random token instead of the mask, the loss covers them and the other filled positions of the noisy stream, and the
option goes through the trainer's checks, exact resume and DDP like the other objective settings."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from test_train import (_cli, _Kill, _one_line_error, _sdar_and_chat, corpus, join_ddp, spawn_ddp,  # noqa: F401
                        tiny_cfg, tiny_model, tokdir)
from unmask.train.checkpoint import CheckpointError
from unmask.train.corruption import draw_corruption, keep_positions
from unmask.train.objectives import Noise, Objective, diffusion_loss_sum, draw_noise
from unmask.train.trainer import TrainConfig, TrainConfigError, train

V, MASK = 64, 3


def _batch(B: int = 64, L: int = 32, seed: int = 5) -> torch.Tensor:
    return torch.randint(16, 62, (B, L), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ the noise

def test_corrupted_positions_are_noised_positions_holding_a_wrong_token_at_the_asked_share():
    x0 = _batch()
    lm = torch.ones_like(x0, dtype=torch.bool)
    lm[:, :8] = False  # an SFT prompt: never noised, never corrupted
    base = Objective(mask_id=MASK, block_sizes=(8,), shift=True, causal_context=True)
    obj = replace(base, corrupt_fraction=0.3, vocab_size=V)
    n = draw_noise(obj, lm, torch.Generator().manual_seed(0), x0)
    plain = draw_noise(base, lm, torch.Generator().manual_seed(0))
    # the masks, p and block size are those of the run without the option (corruption is drawn after them)
    assert torch.equal(n.masked, plain.masked) and torch.equal(n.p, plain.p) and n.block_size == plain.block_size
    assert plain.corrupt is None and plain.keep is None
    assert not (n.corrupt & ~n.masked).any() and not n.corrupt[:, :8].any()
    share = n.corrupt.sum().item() / n.masked.sum().item()
    assert 0.27 < share < 0.33, share  # of ~800 noised positions
    planted = n.tokens[n.corrupt]
    assert (planted != x0[n.corrupt]).all() and (planted != MASK).all()
    assert planted.min() >= 0 and planted.max() < V
    assert torch.equal(n.tokens[~n.corrupt], x0[~n.corrupt])
    # keep: the eligible filled positions, less each block's first (a shifted model reads it from the clean row)
    want = lm & ~n.masked
    want[:, 0::8] = False
    assert torch.equal(n.keep, want)
    assert torch.equal(draw_noise(obj, lm, torch.Generator().manual_seed(0), x0).tokens, n.tokens)  # seeded
    with pytest.raises(ValueError, match="needs x0"):
        draw_noise(obj, lm, torch.Generator().manual_seed(0))


def test_random_tokens_cover_the_vocabulary_less_the_mask_and_the_right_token():
    masked = torch.ones(1, 20000, dtype=torch.bool)
    x0 = torch.full((1, 20000), 7)
    corrupt, tokens = draw_corruption(masked, x0, 1.0, 10, MASK, torch.Generator().manual_seed(0))
    assert corrupt.all()
    counts = torch.bincount(tokens.flatten(), minlength=10)
    assert counts[MASK] == 0 and counts[7] == 0
    others = counts[[0, 1, 2, 4, 5, 6, 8, 9]].float()
    assert (others / 20000 - 1 / 8).abs().max() < 0.01  # uniform over the 8 others
    none, same = draw_corruption(masked, x0, 0.0, 10, MASK, torch.Generator().manual_seed(0))
    assert not none.any() and torch.equal(same, x0)


def test_keep_positions_of_unshifted_and_bidirectional_models_include_block_starts():
    eligible = torch.ones(1, 8, dtype=torch.bool)
    masked = torch.tensor([[False, True, False, False, False, False, True, False]])
    assert keep_positions(eligible, masked, 4, shift=False).tolist() == [[1, 0, 1, 1, 1, 1, 0, 1]]
    assert keep_positions(eligible, masked, 4, shift=True).tolist() == [[0, 0, 1, 1, 0, 1, 0, 1]]
    assert keep_positions(eligible, masked, None, shift=True).tolist() == [[1, 0, 1, 1, 1, 1, 0, 1]]


@pytest.mark.parametrize("kw, match", [
    (dict(corrupt_fraction=1.5, vocab_size=V), "corrupt_fraction must be in"),
    (dict(corrupt_fraction=0.2), "vocab_size"),
    (dict(corrupt_fraction=0.2, vocab_size=V, causal=True, shift=True), "causal"),
])
def test_bad_objectives_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Objective(mask_id=MASK, **kw)


# ------------------------------------------------------------------ the loss

def test_loss_covers_masked_corrupted_and_kept_positions_by_hand():
    """Bidirectional form: one pass over x_t (masks, planted tokens, the rest right); CE/p at every noised position
    (masked or corrupted), plus CE at every kept position."""
    model = tiny_model()
    x0 = _batch(2, 12, seed=1)
    obj = Objective(mask_id=MASK, corrupt_fraction=0.5, vocab_size=V)
    n = draw_noise(obj, torch.ones_like(x0, dtype=torch.bool), torch.Generator().manual_seed(3), x0)
    assert n.corrupt.any() and (n.masked & ~n.corrupt).any() and n.keep.any()
    xt = torch.where(n.masked & ~n.corrupt, MASK, n.tokens)
    pos = torch.arange(12)[None]
    with torch.no_grad():
        lg = model.logits(model.forward_dense(xt, pos.expand(2, 12), None))
    ce = -F.log_softmax(lg, -1).gather(-1, x0[..., None])[..., 0]
    want = (ce[n.masked] / n.p[n.masked]).sum() + ce[n.keep].sum()
    got = diffusion_loss_sum(model, x0, n, obj)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    # without the corruption fields the same masks give the plain loss (no keep term)
    plain = diffusion_loss_sum(model, x0, Noise(None, n.masked, n.p), replace(obj, corrupt_fraction=0.0))
    xt = torch.where(n.masked, MASK, x0)
    with torch.no_grad():
        lg = model.logits(model.forward_dense(xt, pos.expand(2, 12), None))
    ce = -F.log_softmax(lg, -1).gather(-1, x0[..., None])[..., 0]
    assert plain.item() == pytest.approx((ce[n.masked] / n.p[n.masked]).sum().item(), rel=1e-5)


def test_shifted_block_loss_reads_each_scored_token_as_block_by_block_decoding_does():
    """Shifted block diffusion with a causal context (the built-in model's form): token j of block b is scored from
    row j-1 of [x_0 before the block, causal ; x_t of the block (masks and planted tokens), bidirectional], the
    sequence the engine runs when it edits; a block's first token from the clean row before it."""
    model = tiny_model()
    B, L = 4, 12
    x0 = _batch(2, L, seed=2)
    obj = Objective(mask_id=MASK, block_sizes=(B,), shift=True, causal_context=True, corrupt_fraction=0.5,
                    vocab_size=V)
    n = draw_noise(obj, torch.ones_like(x0, dtype=torch.bool), torch.Generator().manual_seed(4), x0)
    assert n.block_size == B and n.corrupt.any() and n.keep.any()
    xt = torch.where(n.masked & ~n.corrupt, MASK, n.tokens)
    want = 0.0
    for b in range(2):
        for j, w in [(j, 1 / n.p[b, j].item()) for j in n.masked[b].nonzero().flatten().tolist()] + \
                    [(j, 1.0) for j in n.keep[b].nonzero().flatten().tolist()]:
            start = j // B * B
            seq = torch.cat([x0[b, :start], xt[b, start:start + B]])
            p = torch.arange(seq.numel())
            ids = torch.where(p < start, p, start)
            with torch.no_grad():
                lg = model.logits(model.forward_dense(seq[None], p[None], (ids[None, :] <= ids[:, None])[None, None]))
            want += -F.log_softmax(lg[0, j - 1], -1)[x0[b, j]].item() * w
    got = diffusion_loss_sum(model, x0, n, obj)
    assert got.item() == pytest.approx(want, rel=1e-5)


# ------------------------------------------------------------------ the trainer

def test_config_checks_and_cli_errors(tmp_path, tokdir, corpus):
    with pytest.raises(TrainConfigError, match="corrupt_fraction must be in"):
        TrainConfig(corrupt_fraction=-0.1)
    with pytest.raises(TrainConfigError, match="corrupt_fraction acts on masked positions"):
        TrainConfig(corrupt_fraction=0.2, objective="causal")
    r = _cli("train", "--data", corpus, "--tokenizer", tokdir, "--out", tmp_path / "x", "--corrupt-fraction", "1.5")
    assert r.exit_code == 2 and "--corrupt-fraction" in r.output and "Traceback" not in r.output  # typer: range
    r = _cli("train", "--data", corpus, "--tokenizer", tokdir, "--out", tmp_path / "y", "--objective", "causal",
             "--corrupt-fraction", "0.2")
    _one_line_error(r, "corrupt_fraction is a diffusion setting")


def test_resume_with_corruption_is_bit_exact(tmp_path, tokdir, corpus):
    cfg = dict(total_steps=8, corrupt_fraction=0.3)
    full = train(tiny_cfg(tmp_path / "a", **cfg), corpus, tokdir)
    plain = train(tiny_cfg(tmp_path / "p", total_steps=8), corpus, tokdir)
    assert full.losses[0] != plain.losses[0]  # the option changes what is trained

    def kill_at_5(step, metrics):
        if step == 5:
            raise _Kill
    with pytest.raises(_Kill):
        train(tiny_cfg(tmp_path / "b", save_every=3, **cfg), corpus, tokdir, on_step=kill_at_5)
    res = train(tiny_cfg(tmp_path / "b", save_every=3, resume=True, **cfg), corpus, tokdir)
    assert res.losses == full.losses  # bit for bit
    for (name, a), (_, b) in zip(full.model.state_dict().items(), res.model.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match="corrupt_fraction was 0.3, now 0.1"):
        train(tiny_cfg(tmp_path / "b", save_every=3, resume=True, total_steps=8, corrupt_fraction=0.1), corpus,
              tokdir)


def _ddp_worker(rank: int, world: int, port: int, out: str, tokdir: str, corpus: str) -> None:
    join_ddp(rank, world, port)
    res = train(tiny_cfg(Path(out), total_steps=2, corrupt_fraction=0.3), corpus, tokdir)
    Path(out, f"losses{rank}.json").write_text(json.dumps(res.losses))


def test_ddp_with_corruption_matches_one_process(tmp_path, tokdir, corpus):
    single = train(tiny_cfg(tmp_path / "one", total_steps=2, corrupt_fraction=0.3), corpus, tokdir)
    for losses in spawn_ddp(_ddp_worker, tmp_path / "ddp", str(tokdir), str(corpus)):
        assert losses == pytest.approx(single.losses, abs=1e-6)



def test_finetune_cli_trains_with_corruption_and_resumes_only_with_the_same_share(tmp_path, tokdir):
    src, data = _sdar_and_chat(tmp_path, tokdir)
    ft = ("--data", data, "--out", tmp_path / "run", "--seq-len", 96, "--batch-size", 4, "--warmup", 0,
          "--eval-every", 0, "--no-bf16")
    r = _cli("finetune", "-m", src, *ft, "--steps", 2, "--corrupt-fraction", 0.25)
    assert r.exit_code == 0, r.output
    assert "25% of noised positions a random token" in r.stdout
    r = _cli("finetune", "-m", src, *ft, "--steps", 3, "--resume", "--corrupt-fraction", 0.25)
    assert r.exit_code == 0 and "resumed at step 2" in r.stdout, r.output
    r = _cli("finetune", "-m", src, *ft, "--steps", 4, "--resume")
    _one_line_error(r, "cannot resume: corrupt_fraction was 0.25, now 0.0")
