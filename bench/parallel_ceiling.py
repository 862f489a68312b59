"""The parallelism ceiling of a model: how many tokens per forward ANY commit rule could reach without changing
a single token of the model's own one-token-per-forward answer.

For each held-out task the model first answers one token per forward, greedy (the reference answer R, its stop
token included when it ended on one). Then an oracle decodes the same canvas (same blocks, same attention) and,
at every step, commits every masked position whose argmax already equals R there; when none does, it commits
the leftmost masked position with R's token (what one-token decoding does). The result is exactly R, in the
fewest steps a rule that only looks at the model's argmaxes could take. Since a real rule (threshold, learned
filter) must also decide WHICH argmaxes to trust, this is an upper bound on its tokens per forward at unchanged
output: if it is far below a goal, no decoding rule reaches the goal on this model; only training can raise it.

Figures: answer tokens per denoising forward (prefill not counted), and the same with one prefill forward per
request counted as `unmask eval` counts it. Also per block offset: the share of first-step argmaxes that
already equal R (how far ahead the model can see in one forward).

    .venv/bin/python bench/parallel_ceiling.py --model bench/models/unmask-tiny-5m --json docs/bench/ceiling-5m.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchlib.common import write_json
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.evaluation import FUNCTION_TOKENS, function_tasks, next_line_tasks
from unmask.train.corpus import read_documents


def attention_mask(length: int, start: int, block: int, causal_context: bool) -> torch.Tensor:
    """[1, 1, L, L] bool: the block-causal mask of the engine's block-causal families (causal_context: committed
    tokens attend token-causally, the open block from `start` is one bidirectional group)."""
    pos = torch.arange(length)
    if causal_context:
        ids = torch.where(pos < start, pos, torch.full_like(pos, start))
        return (ids[None, :] <= ids[:, None])[None, None]
    return ((pos[None, :] // block) <= (pos[:, None] // block))[None, None]


@torch.inference_mode()
def oracle_decode(model, spec, prompt: list[int], ref: list[int], block: int) -> tuple[int, list[list[bool]]]:
    """(denoising forwards the oracle needs to write `ref` after `prompt`, first-step hits per block offset)."""
    mask = spec.mask_id
    P, end = len(prompt), len(prompt) + len(ref)
    seq = torch.full((end,), mask)
    seq[:P] = torch.tensor(prompt)
    want = torch.tensor(ref)
    start, forwards, first_hits = (P // block) * block, 0, []
    while start < end:
        stop = min(start + block, end)
        first = True
        while bool((seq[max(start, P):stop] == mask).any()):
            pos = torch.arange(stop)
            hidden = model.forward_dense(seq[None, :stop], pos[None], attention_mask(stop, start, block,
                                                                                      spec.causal_context))
            lo = max(start, P)
            rows = torch.arange(lo, stop) - int(spec.shift)
            logits = model.logits(hidden)[0, rows].float()
            logits[:, mask] = float("-inf")
            guess = logits.argmax(-1)
            target = want[lo - P:stop - P]
            masked = seq[lo:stop] == mask
            hit = masked & (guess == target)
            if first:
                first_hits.append([bool(h) for h in (guess == target)])
                first = False
            if not bool(hit.any()):
                hit = torch.zeros_like(masked)
                hit[int(masked.nonzero()[0])] = True
            seq[lo:stop][hit] = target[hit]
            forwards += 1
        start = stop
    return forwards, first_hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench/models/unmask-tiny-5m")
    ap.add_argument("--heldout", default="data/corpus/heldout.jsonl")
    ap.add_argument("--limit", type=int, default=60, help="tasks of each kind")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", device="cpu")
    model, spec = llm.model, llm.spec
    block = args.block_size or spec.block_size
    docs = list(read_documents(Path(args.heldout)))
    stops = set(spec.stop_ids)
    out = {"model": args.model, "block_size": block, "tasks": {}}
    for kind, tasks, max_tokens in (("next_line", next_line_tasks(docs, args.limit), 48),
                                    ("function", function_tasks(docs, args.limit), FUNCTION_TOKENS)):
        tokens = forwards = requests = 0
        offset_hits = [[0, 0] for _ in range(block)]
        for t in tasks:
            prompt = llm.encode(t.prompt)
            params = GenerationParams(max_tokens=max_tokens, policy="topk", tokens_per_step=1, block_size=block,
                                      stop=list(t.stop), min_tokens=t.min_tokens)
            o = llm.generate([prompt], params)[0]
            # the reference as the canvas held it: the answer's tokens, plus the stop token that ended it
            ref = list(o.token_ids)
            if o.finish_reason == "stop" and len(ref) < max_tokens and not t.stop:
                ref.append(min(stops))
            if not ref:
                continue
            f, first_hits = oracle_decode(model, spec, prompt, ref, block)
            tokens, forwards, requests = tokens + len(ref), forwards + f, requests + 1
            for hits in first_hits:
                for k, h in enumerate(hits[:block]):
                    offset_hits[k][0] += h
                    offset_hits[k][1] += 1
        row = {"requests": requests, "tokens": tokens, "denoising_forwards": forwards,
               "tokens_per_denoising_forward": tokens / max(forwards, 1),
               "tokens_per_forward_with_prefill": tokens / max(forwards + requests, 1),
               "first_step_hit_rate_by_offset": [h / n if n else None for h, n in offset_hits]}
        out["tasks"][kind] = row
        print(kind, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                if k != "first_step_hit_rate_by_offset"}),
              "hit rate by offset", [round(x, 2) if x is not None else None for x in row["first_step_hit_rate_by_offset"]],
              flush=True)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
