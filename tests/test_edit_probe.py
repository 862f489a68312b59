"""bench/edit_probe.py: the planted tokens (as corruption training draws them) and what the probe reads off a model,
on stand-in models whose answers are known: one that always knows the right token, one that keeps what it reads."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import edit_probe  # noqa: E402

V, MASK, B = 32, 3, 8


class NextTokenModel:
    """A shifted stand-in: row j of either stream of [x_t ; x_0] answers token j + 1 with logit 30 (p ~ 1), taken
    from the clean stream (`oracle`) or from the stream the row is in (it keeps what it reads)."""

    def __init__(self, oracle: bool):
        self.oracle = oracle

    def forward_dense(self, ids, pos, attn):
        L = ids.shape[1] // 2
        xt, x0 = ids[:, :L], ids[:, L:]
        nxt = lambda x: torch.cat([x[:, 1:], x[:, :1]], 1)  # noqa: E731 (the last row's answer is never read)
        noisy = nxt(x0) if self.oracle else nxt(xt)
        return 30.0 * F.one_hot(torch.cat([noisy, nxt(x0)], 1), V).float()

    def logits(self, hidden):
        return hidden


def rows(n: int = 3, length: int = 32) -> torch.Tensor:
    x0 = torch.randint(4, V, (n, length), generator=torch.Generator().manual_seed(1))
    x0[0, 5] = MASK  # a right token equal to the mask id still gets a planted token that is neither
    return x0


def test_plant_one_wrong_token_per_block_never_the_first():
    x0 = rows()
    planted, tokens = edit_probe.plant(x0, B, V, MASK, torch.Generator().manual_seed(0))
    per_block = planted.view(3, 4, B)
    assert per_block.sum(-1).tolist() == [[1] * 4] * 3 and not per_block[..., 0].any()
    assert (tokens[planted] != x0[planted]).all() and (tokens[planted] != MASK).all()
    assert torch.equal(tokens[~planted], x0[~planted])
    again = edit_probe.plant(x0, B, V, MASK, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], planted) and torch.equal(again[1], tokens)  # seeded


def test_probe_reads_fixes_and_false_edits_off_the_model():
    x0 = rows()
    taus = [0.9, 0.5]
    knows = edit_probe.probe(NextTokenModel(oracle=True), x0, B, V, MASK, True, True, taus,
                             torch.Generator().manual_seed(0))
    keeps = edit_probe.probe(NextTokenModel(oracle=False), x0, B, V, MASK, True, True, taus,
                             torch.Generator().manual_seed(0))
    # 12 blocks: 12 planted; 96 positions less the planted and the 12 block-first ones are right
    assert [(r["planted"], r["right"]) for r in knows["rows"]] == [(12, 72)] * 2
    assert [(r["fixed"], r["false_edits"]) for r in knows["rows"]] == [(1.0, 0.0)] * 2
    assert knows["p_right_at_planted"] > 0.999 and knows["p_right_at_right"] > 0.999
    # a model that keeps what it reads proposes the planted token back: nothing fixed, nothing broken
    assert [(r["fixed"], r["false_edits"]) for r in keeps["rows"]] == [(0.0, 0.0)] * 2
    assert keeps["p_right_at_planted"] < 1e-9 and keeps["p_right_at_right"] > 0.999
