"""What the edit rule would do on a full block, read straight off the model: one wrong token planted per block of
held-out text (a random token, drawn as `--corrupt-fraction` training draws them: `train.corruption.draw_corruption`),
every other position right.

For each edit threshold, `fixed` is the share of planted positions where the model proposes the right token with
p above the threshold (the edit rule puts it back), `false_edits` the share of right positions where it proposes
another token with p above it (the rule would break them). One pass of the training objective's block-diffusion
form over [x_t ; x_0] per batch, which reads each block as the engine does once the block is full (its post-edit
steps). A shifted model's block-first position is neither planted nor counted: it is read from the row before the
block, which sees nothing of the block, so what it proposes there does not depend on a planted token.

    .venv/bin/python bench/edit_probe.py --model bench/models/unmask-tiny-5m --json runs/probe.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor

from benchlib.common import write_json
from unmask.train.corruption import draw_corruption
from unmask.train.objectives import Noise, Objective, masked_rows, source_rows


def plant(x0: Tensor, block_size: int, vocab_size: int, mask_id: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(planted [R, L] bool: one position per block, never a block's first; tokens [R, L]: a random wrong token
    there, never the mask or the right one, x0 elsewhere)."""
    R, L = x0.shape
    offset = torch.randint(1, block_size, (R, L // block_size), generator=gen)
    planted = torch.zeros_like(x0, dtype=torch.bool)
    planted.view(R, L // block_size, block_size).scatter_(2, offset[..., None], True)
    _, tokens = draw_corruption(planted, x0, 1.0, vocab_size, mask_id, gen)
    return planted, tokens


def probe(model, x0: Tensor, block_size: int, vocab_size: int, mask_id: int, shift: bool, causal_context: bool,
          thresholds: list[float], gen: torch.Generator) -> dict:
    """The probe's figures for rows `x0` [R, L] (L a multiple of `block_size`): one row per threshold, and the mean
    p of the right token at planted and at right positions."""
    B, L = block_size, x0.shape[1]
    planted, tokens = plant(x0, B, vocab_size, mask_id, gen)
    right = ~planted
    right[:, ::B] = False
    obj = Objective(mask_id=mask_id, block_sizes=(B,), shift=shift, causal_context=causal_context)
    noise = Noise(B, planted, torch.ones(x0.shape), planted, tokens, None)
    with torch.no_grad():
        hidden, b, j, src = masked_rows(model, x0, planted, obj, B, noise)
        probs_p = torch.softmax(model.logits(hidden[b, src]).float(), -1)
        rb, rj = right.nonzero(as_tuple=True)
        probs_r = torch.softmax(model.logits(hidden[rb, source_rows(rj, obj, B, L)]).float(), -1)
    p_top, top = probs_p.max(-1)
    r_top, rtop = probs_r.max(-1)
    rows = [{"edit_threshold": tau,
             "fixed": float(((top == x0[b, j]) & (p_top > tau)).float().mean()),
             "false_edits": float(((rtop != x0[rb, rj]) & (r_top > tau)).float().mean()),
             "planted": int(b.numel()), "right": int(rb.numel())} for tau in thresholds]
    return {"rows": rows, "p_right_at_planted": float(probs_p.gather(1, x0[b, j][:, None]).mean()),
            "p_right_at_right": float(probs_r.gather(1, x0[rb, rj][:, None]).mean())}


def main() -> None:
    from unmask.engine.llm import LLM
    from unmask.train.corpus import read_documents

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="src/unmask/assets/unmask-tiny")
    ap.add_argument("--heldout", default="data/corpus/heldout.jsonl")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--thresholds", default="0.9,0.7,0.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", device="cpu")
    model, traits = llm.model, llm.engine.traits
    ids: list[int] = []
    for doc in read_documents(Path(args.heldout)):
        ids += llm.encode(doc.text)
        if len(ids) >= args.rows * args.seq_len:
            break
    x0 = torch.tensor(ids[:args.rows * args.seq_len]).view(-1, args.seq_len)
    res = probe(model, x0, args.block_size, model.lm_head.weight.shape[0], traits.mask_id, traits.shift,
                traits.causal_context, [float(t) for t in args.thresholds.split(",")],
                torch.Generator().manual_seed(args.seed))
    for row in res["rows"]:
        print(json.dumps(row), flush=True)
    print(json.dumps({k: v for k, v in res.items() if k.startswith("p_")}))
    if args.json:
        write_json(args.json, {"model": args.model, "block_size": args.block_size, "seq_len": args.seq_len, **res})


if __name__ == "__main__":
    main()
