"""Reference decode for the engine tests: every step recomputes the whole sequence densely, no cache, no fusion.

Written from the rules in docs/decoding.md, not from the engine's code: blocks (absolutely aligned for the
block-causal families), sub-blocks decoded left to right (`small_block_size`), and the early stop (nothing after
a committed stop token is decoded; the output ends at the first stop token).
"""
import torch

from unmask.decoding import BlockState, decide
from unmask.engine.params import GenerationParams


def naive_generate(model, spec, prompt, params: GenerationParams):
    mask = spec.mask_id
    B = params.block_size or spec.block_size
    S = params.small_block_size or B
    P, end = len(prompt), len(prompt) + params.max_tokens
    seq = torch.full((end,), mask)
    seq[:P] = torch.tensor(prompt)
    bidir = spec.family.attention == "bidirectional"
    start = P if bidir else (P // B) * B
    gen = torch.Generator().manual_seed(params.seed or 0)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(spec.stop_ids))

    def first_stop(hi: int) -> int:
        out = seq[P:hi].tolist()
        return next((P + i for i, t in enumerate(out) if t in stops and t != mask), hi)

    while True:
        stop_blk = min(start + B, end)
        for lo in range(start, stop_blk, S):
            hi = min(lo + S, stop_blk)
            state = BlockState(initial_masked=int((seq[lo:hi] == mask).sum()))
            while True:
                cap = min(hi, first_stop(stop_blk))
                targets = (seq[lo:cap] == mask).nonzero(as_tuple=True)[0] + lo if cap > lo else seq[:0]
                if targets.numel() == 0:
                    break
                L = end if bidir else stop_blk
                pos = torch.arange(L)
                if bidir:
                    m = None
                elif spec.causal_context:  # committed tokens causal, the active block one bidirectional group
                    ids = torch.where(pos < start, pos, start)
                    m = (ids[None, :] <= ids[:, None])[None, None]
                else:
                    m = ((pos[None, :] // B) <= (pos[:, None] // B))[None, None]
                with torch.inference_mode():
                    logits = model.logits(model.forward_dense(seq[None, :L], pos[None], m))[0]
                lg = logits[targets - int(spec.shift)].clone()
                lg[:, mask] = float("-inf")
                first = spec.ar_first_token and state.step == 0 and int(targets[0]) == start
                d = decide(params.policy_config(), lg, targets - start, state, params.sampling(), gen)
                commit = d.commit.clone()
                if first:
                    commit[0] = True
                seq[targets[commit]] = d.tokens[commit]
        out = seq[P:stop_blk].tolist()
        for i, t in enumerate(out):
            if t in stops:
                return out[:i]
        if stop_blk >= end:
            return out
        start = stop_blk
