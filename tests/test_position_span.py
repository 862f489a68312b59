"""PoSE-style skipped positions for long-context training (`unmask train --position-span`, objectives.py): rows of L
tokens whose RoPE positions reach a longer span, drawn after the masks, read by both streams of block diffusion."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from test_train import _cli, _one_line_error, tiny_model  # noqa: F401
from unmask.train.objectives import Noise, Objective, diffusion_loss_sum, draw_noise, skipped_positions

MASK = 3


def test_skipped_positions_keep_the_text_contiguous_and_reach_the_span():
    pos = skipped_positions(500, 64, 1024, torch.Generator().manual_seed(0))
    assert pos.shape == (500, 64) and pos.dtype == torch.long
    assert (pos[:, 0] == 0).all() and (pos.max(1).values <= 1023).all()
    steps = pos.diff(dim=1)
    # one jump per row at most (the cut), every other neighbour one position apart
    assert ((steps != 1).sum(1) <= 1).all() and (steps >= 1).all()
    assert int((steps > 1).any(1).sum()) > 490  # a zero skip is one draw in 961
    # the cut falls anywhere in [1, 64) and the skip anywhere in [0, 960]: the span is covered
    assert pos[:, -1].max() > 1000 and pos[:, -1].min() < 200
    again = skipped_positions(500, 64, 1024, torch.Generator().manual_seed(0))
    assert torch.equal(pos, again)
    with pytest.raises(ValueError, match="shorter than the rows"):
        skipped_positions(1, 64, 32, torch.Generator())


def test_positions_are_drawn_after_the_masks():
    lm = torch.ones(4, 32, dtype=torch.bool)
    base = Objective(mask_id=MASK, block_sizes=(4, 8), shift=True)
    plain = draw_noise(base, lm, torch.Generator().manual_seed(1))
    pose = draw_noise(replace(base, position_span=256), lm, torch.Generator().manual_seed(1))
    assert plain.positions is None
    assert torch.equal(plain.masked, pose.masked) and torch.equal(plain.p, pose.p)
    assert pose.positions.shape == (4, 32) and int(pose.positions.max()) > 31
    assert torch.equal(pose.rows(slice(1, 3)).positions, pose.positions[1:3])  # a DDP rank's rows
    with pytest.raises(ValueError, match="position_span must be >= 0"):
        Objective(mask_id=MASK, position_span=-1)
    assert "span of 256 (PoSE)" in replace(base, position_span=256).describe()


@pytest.mark.parametrize("obj", [Objective(mask_id=MASK), Objective(mask_id=MASK, block_sizes=(4,), shift=True)],
                         ids=["bidirectional", "block-diffusion"])
def test_the_loss_reads_the_drawn_positions(obj):
    """RoPE sees only distances: positions shifted as a whole give the plain loss; a skip inside the row does not.
    In block diffusion both streams ([x_t ; x_0]) take the row's positions."""
    model = tiny_model()
    x0 = torch.randint(16, 62, (2, 16), generator=torch.Generator().manual_seed(2))
    n = draw_noise(obj, torch.ones_like(x0, dtype=torch.bool), torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = diffusion_loss_sum(model, x0, n, obj).item()
        ar = torch.arange(16).expand(2, 16)
        same = diffusion_loss_sum(model, x0, replace(n, positions=ar.clone()), obj).item()
        moved = diffusion_loss_sum(model, x0, replace(n, positions=ar + 300), obj).item()
        skipped = ar + torch.where(ar >= 8, 300, 0)
        jumped = diffusion_loss_sum(model, x0, replace(n, positions=skipped), obj).item()
    assert same == plain
    assert moved == pytest.approx(plain, rel=1e-4)
    assert abs(jumped - plain) > 1e-3 * abs(plain)


def test_train_cli_position_span(tmp_path, monkeypatch):
    """`unmask train --position-span` trains rows of --seq-len at positions reaching the span, within the context
    the model declares; a span no longer than the rows or past the context is refused in one line."""
    from test_long_context_data import _package_corpus

    tok, data, flags = _package_corpus(tmp_path, monkeypatch)
    r = _cli("train", "--data", data, "--tokenizer", tok, "--out", tmp_path / "run", *flags, "--long-documents",
             "--passkey-fraction", 0.25, "--rope-scaling", "yarn:2", "--position-span", 4096)
    assert r.exit_code == 0, r.output
    assert "positions skipped over a span of 4,096 (PoSE)" in r.output
    saved = torch.load(tmp_path / "run/checkpoint.pt", weights_only=False)
    assert saved["config"]["position_span"] == 4096
    assert json.loads((tmp_path / "run/model/config.json").read_text())["max_position_embeddings"] == 4096
    _one_line_error(_cli("train", "--data", data, "--tokenizer", tok, "--out", tmp_path / "short", *flags,
                         "--position-span", 128), "position_span must be 0 (off) or longer than seq_len 128")
    _one_line_error(_cli("train", "--data", data, "--tokenizer", tok, "--out", tmp_path / "far", *flags,
                         "--position-span", 4096), "past the model's context (max_position_embeddings 2,048)")
    # a resumed run must draw the same positions: the span is one of the settings it must share
    _one_line_error(_cli("train", "--data", data, "--tokenizer", tok, "--out", tmp_path / "run", *flags,
                         "--long-documents", "--passkey-fraction", 0.25, "--rope-scaling", "yarn:2", "--resume",
                         "--steps", 6), "position_span was 4096, now 0")
