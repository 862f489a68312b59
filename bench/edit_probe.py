"""What the edit rule would do on a full block, read straight off the model: one wrong token planted per block of
held-out text (a random token, as `--corrupt-fraction` trains with), every other position right.

For each edit threshold, `fixed` is the share of planted positions where the model proposes the right token with
p above the threshold (the edit rule puts it back), `false_edits` the share of right positions where it proposes
another token with p above it (the rule would break them). One pass of the training objective's block-diffusion
form over [x_t ; x_0] per batch, which reads each block as the engine does once the block is full (its post-edit
steps); a shifted model's block-first position is neither planted nor counted (decoding cannot revise it).

    .venv/bin/python bench/edit_probe.py --model bench/models/unmask-tiny-5m --json runs/probe.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from unmask.engine.llm import LLM
from unmask.train.corpus import read_documents
from unmask.train.objectives import Noise, Objective, masked_rows, source_rows


def main() -> None:
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
    shift, causal_context, mask_id = traits.shift, traits.causal_context, traits.mask_id
    vocab = model.lm_head.weight.shape[0]
    ids: list[int] = []
    for doc in read_documents(Path(args.heldout)):
        ids += llm.encode(doc.text)
        if len(ids) >= args.rows * args.seq_len:
            break
    L, B = args.seq_len, args.block_size
    x0 = torch.tensor(ids[:args.rows * L]).view(-1, L)
    gen = torch.Generator().manual_seed(args.seed)
    # one planted position per block, never a block's first (position 0 of the row has no predictor when shifted)
    offset = torch.randint(1, B, (x0.shape[0], L // B), generator=gen)
    planted = torch.zeros_like(x0, dtype=torch.bool)
    planted.view(x0.shape[0], L // B, B).scatter_(2, offset[..., None], True)
    r = torch.randint(vocab - 2, x0.shape, generator=gen)
    lo, hi = torch.minimum(x0, torch.full_like(x0, mask_id)), torch.maximum(x0, torch.full_like(x0, mask_id))
    wrong = r + (r >= lo).long()
    wrong = wrong + (wrong >= hi).long()
    tokens = torch.where(planted, wrong, x0)
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
    rows = []
    for tau in (float(t) for t in args.thresholds.split(",")):
        row = {"edit_threshold": tau,
               "fixed": float(((top == x0[b, j]) & (p_top > tau)).float().mean()),
               "false_edits": float(((rtop != x0[rb, rj]) & (r_top > tau)).float().mean()),
               "planted": int(b.numel()), "right": int(rb.numel())}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"model": args.model, "block_size": B, "seq_len": L, "rows": rows,
           "p_right_at_planted": float(probs_p.gather(1, x0[b, j][:, None]).mean()),
           "p_right_at_right": float(probs_r.gather(1, x0[rb, rj][:, None]).mean())}
    print(json.dumps({k: v for k, v in out.items() if k.startswith("p_")}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
