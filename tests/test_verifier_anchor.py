"""Holding the verifier (`anchor_weight`): KL(starting model || model) on the clean next-token rows of a
causal-context model, the rows policy speculative's output is read from. The term against a plain causal pass,
what it does to a distillation, exact resume with it, its compute in distill.json, finetune's flag, errors."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from test_distill import TRAJ, _cfg, chat_file, corpus, distill_killed_at_2  # noqa: F401 (fixtures)
from test_train import _cli, _one_line_error, tiny_cfg, tokdir  # noqa: F401 (tokdir: a fixture)
from unmask.models.loader import load_model
from unmask.models.transformer import CAUSAL
from unmask.train.config import TrainConfig
from unmask.train.distill import distill
from unmask.train.model_init import load_trainable
from unmask.train.objectives import Objective, diffusion_loss_sum, draw_noise, loss_eligible
from unmask.train.trainer import TrainConfigError, frozen_copy, train

MASK = 3


@pytest.fixture(scope="module")
def causal_base(tmp_path_factory, tokdir, corpus) -> Path:
    """A tiny unmask model with a causal context (its clean stream read token-causally), as the built-in is."""
    root = tmp_path_factory.mktemp("cc")
    causal = train(tiny_cfg(root / "causal", total_steps=2, seq_len=64, objective="causal", block_sizes=None),
                   corpus, tokdir)   # shifted logits, as unmask-tiny's causal base
    res = train(tiny_cfg(root / "run", total_steps=2, seq_len=64, causal_context=True), corpus, tokdir,
                init_from=causal.model_dir)
    assert json.loads((res.model_dir / "config.json").read_text())["causal_context"] is True
    return res.model_dir


@pytest.fixture(scope="module")
def shifted_base(tmp_path_factory, tokdir, corpus) -> Path:
    """Shifted block diffusion without a causal context: no next-token verifier to hold."""
    return train(tiny_cfg(tmp_path_factory.mktemp("sh") / "run", total_steps=2, seq_len=64), corpus, tokdir).model_dir


def _causal_log_probs(model, x0: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(x0.shape[1]).expand_as(x0)
    with torch.no_grad():
        return F.log_softmax(model.logits(model.forward_dense(x0, pos, CAUSAL)).float(), -1)


def test_the_term_is_the_kl_of_the_causal_next_token_rows(causal_base):
    """At the start the anchor is the model, so the term is 0; once the model moves it is the weighted KL of the
    anchor's next-token distribution to the model's, row for row as one causal pass over x0 computes them (the
    clean rows of the two-stream pass read nothing else)."""
    model = load_trainable(causal_base).model.float()   # as the trainer holds it
    anchor = frozen_copy(model)
    plain = Objective(mask_id=MASK, block_sizes=(4,), shift=True, causal_context=True)
    held = Objective(mask_id=MASK, block_sizes=(4,), shift=True, causal_context=True, anchor_weight=2.5)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randint(16, 60, (3, 24), generator=gen)
    scored = torch.zeros_like(x0, dtype=torch.bool)
    scored[:, 8:] = True
    noise = draw_noise(plain, scored, gen, x0)
    eligible = loss_eligible(scored, True)

    def term(m) -> float:
        with torch.no_grad():
            return float(diffusion_loss_sum(m, x0, noise, held, eligible, anchor)
                         - diffusion_loss_sum(m, x0, noise, plain, eligible, anchor))

    assert term(model) == pytest.approx(0.0, abs=1e-4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    p_log, q_log = _causal_log_probs(anchor, x0), _causal_log_probs(model, x0)
    b, j = eligible.nonzero(as_tuple=True)
    want = 2.5 * float((p_log.exp() * (p_log - q_log)).sum(-1)[b, j - 1].sum())
    assert want > 1.0   # the perturbation moved the predictions measurably
    assert term(model) == pytest.approx(want, rel=1e-4)
    # the anchor is a copy, frozen: the model's change did not reach it
    assert all(not p.requires_grad for p in anchor.parameters()) and not anchor.training


def _drift(before: Path, after: Path, ids: torch.Tensor) -> float:
    """Mean KL(before || after) of the next-token predictions over ids."""
    p_log = _causal_log_probs(load_model(before, dtype="float32")[0], ids)
    q_log = _causal_log_probs(load_model(after, dtype="float32")[0], ids)
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def test_held_distillation_moves_the_next_token_predictions_less(tmp_path, causal_base, corpus):
    """The same distillation (lr 1e-2, 6 steps on the model's own answers) with the next-token loss on the
    answers and no anchor, and with the anchor instead: the anchored student's next-token predictions stay
    nearer the base's on text neither trained on, while its masked rows train the same way."""
    run = functools.partial(_cfg, total_steps=6, lr=1e-2, block_sizes=(4,), confidence_weight=0.0)
    free = distill(run(tmp_path / "free", next_token_weight=1.0), causal_base, TRAJ, text=corpus)
    held = distill(run(tmp_path / "held", next_token_weight=0.0, anchor_weight=5.0), causal_base, TRAJ, text=corpus)
    ids = torch.randint(16, 60, (4, 32), generator=torch.Generator().manual_seed(1))
    free_drift, held_drift = _drift(causal_base, free.model_dir, ids), _drift(causal_base, held.model_dir, ids)
    assert held_drift < 0.5 * free_drift, (held_drift, free_drift)
    assert held.losses[-1] < held.losses[0]   # it still trained (the masked rows' loss fell)


def test_resume_holds_to_the_starting_weights_not_the_checkpoints(tmp_path, causal_base, corpus):
    """A resumed run's anchor is the model it started from (the run's --model), so a killed and resumed run
    computes the same losses as one that ran through."""
    cfg = functools.partial(_cfg, total_steps=4, block_sizes=(4,), next_token_weight=0.0, anchor_weight=3.0)
    full = distill(cfg(tmp_path / "full"), causal_base, TRAJ, text=corpus)

    distill_killed_at_2(cfg(tmp_path / "cut", save_every=2), causal_base, corpus)
    resumed = distill(cfg(tmp_path / "cut", save_every=2, resume=True), causal_base, TRAJ, text=corpus)
    assert resumed.losses == pytest.approx(full.losses, abs=1e-6)
    assert full.losses[2] != full.losses[1]   # the steps after the cut train on
    # another weight is another loss: refused on resume, in one line
    with pytest.raises(Exception, match="anchor_weight was 3.0, now 1.0"):
        distill(cfg(tmp_path / "cut", save_every=2, resume=True, anchor_weight=1.0, total_steps=6), causal_base,
                TRAJ, text=corpus)


def test_distill_json_counts_the_anchors_forwards(tmp_path, causal_base, corpus):
    distill(_cfg(tmp_path / "run", total_steps=2, block_sizes=(4,), anchor_weight=1.0), causal_base, TRAJ, text=corpus)
    report = json.loads((tmp_path / "run" / "distill.json").read_text())
    n, student = report["parameters"], report["student"]
    assert student["anchor_weight"] == 1.0
    assert student["anchor_flops"] == 2 * n * 2 * 4 * 64   # one forward over each row's 64 clean tokens
    assert student["flops"] == 6 * n * 2 * 4 * 64 * 2 + student["anchor_flops"]


def test_errors(tmp_path, shifted_base, corpus):
    with pytest.raises(TrainConfigError, match="anchor_weight must be a finite number >= 0"):
        TrainConfig(out_dir=str(tmp_path), anchor_weight=-1.0)
    with pytest.raises(TrainConfigError, match="a draft adapter never changes them"):
        TrainConfig(out_dir=str(tmp_path), anchor_weight=1.0, draft_adapter_rank=4)
    with pytest.raises(ValueError, match="anchor_weight scores the clean stream's next-token rows"):
        Objective(mask_id=MASK, block_sizes=(4,), shift=True, anchor_weight=1.0)
    _one_line_error(_cli("distill", "--model", shifted_base, "--text", corpus, "--out", tmp_path / "a",
                         "--anchor-weight", 1, "--prompts", 4, "--answer-tokens", 4, "--seq-len", 48, "--steps", 1,
                         "--no-bf16"),
                    "anchor_weight holds the next-token rows of a model with a causal context", "has none")


def test_finetune_holds_from_its_first_step(tmp_path, causal_base, chat_file):
    """`unmask finetune --anchor-weight`: the term is 0 at the first step (the same loss as without it) and
    shapes every step after (the losses part)."""
    runs = {}
    for w in (0.0, 2.0):
        r = _cli("finetune", "--model", causal_base, "--data", chat_file, "--out", tmp_path / f"w{w}", "--steps", 3,
                 "--batch-size", 4, "--seq-len", 64, "--warmup", 0, "--eval-every", 0, "--no-bf16", "--lr", "1e-2",
                 "--anchor-weight", w)
        assert r.exit_code == 0, r.output
        state = torch.load(tmp_path / f"w{w}" / "checkpoint.pt", weights_only=False)
        runs[w] = state["losses"]
        assert state["config"]["anchor_weight"] == w
    assert runs[2.0][0] == pytest.approx(runs[0.0][0], abs=1e-5)
    assert runs[2.0][2] != pytest.approx(runs[0.0][2], abs=1e-4)
