"""Reference decode for the engine tests: every step recomputes the whole sequence densely, no cache, no fusion.

Written from the rules in docs/decoding.md, not from the engine's code: blocks (absolutely aligned for the
block-causal families), sub-blocks decoded left to right (`small_block_size`), the next block decoded with the
active one once enough of that is committed (`multi_block_threshold`), and the early stop (nothing after a
committed stop token is decoded; the output ends at the first stop token), and stop tokens in order
(`ordered_stops`, on by default for the built-in family only): a stop token proposed right of the first
undecided position waits; a step left with nothing commits its leftmost target.
"""
import torch

from unmask.decoding import BlockState, decide
from unmask.engine.params import GenerationParams


def naive_generate(model, spec, prompt, params: GenerationParams):
    mask = spec.mask_id
    B = params.block_size or spec.block_size
    S = params.small_block_size or B
    tau = params.multi_block_threshold
    P, end = len(prompt), len(prompt) + params.max_tokens
    seq = torch.full((end,), mask)
    seq[:P] = torch.tensor(prompt)
    bidir = spec.family.attention == "bidirectional"
    start = P if bidir else (P // B) * B
    gen = torch.Generator().manual_seed(params.seed or 0)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(spec.stop_ids))
    ordered = spec.family.name == "unmask" if params.ordered_stops is None else params.ordered_stops

    def first_stop(hi: int) -> int:
        out = seq[P:hi].tolist()
        return next((P + i for i, t in enumerate(out) if t in stops and t != mask), hi)

    while True:
        stop_blk = min(start + B, end)
        for lo in range(start, stop_blk, S):
            hi = min(lo + S, stop_blk)
            state = BlockState(initial_masked=int((seq[lo:hi] == mask).sum()))
            while True:
                tail = stop_blk  # with an open next block (multi-block): its end
                done = int((seq[start:stop_blk] != mask).sum())
                if tau is not None and stop_blk < end and done / (stop_blk - start) >= tau:
                    tail = min(stop_blk + B, end)
                cap = first_stop(tail)
                if not (seq[lo:min(hi, cap)] == mask).any():  # the window is complete up to a stop token
                    break
                thi = min(tail if tail > stop_blk else hi, cap)
                targets = (seq[lo:thi] == mask).nonzero(as_tuple=True)[0] + lo
                L = end if bidir else tail
                pos = torch.arange(L)
                if bidir:
                    m = None
                elif spec.causal_context:  # committed tokens causal, the open block(s) one bidirectional group
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
                if ordered:
                    hole = P + next(i for i, t in enumerate(seq[P:].tolist()) if t == mask)
                    for j, (pos_j, tok) in enumerate(zip(targets.tolist(), d.tokens.tolist())):
                        if commit[j] and tok in stops and pos_j != hole:
                            commit[j] = False
                    if not commit.any():
                        commit[0] = True
                seq[targets[commit]] = d.tokens[commit]
        out = seq[P:stop_blk].tolist()
        for i, t in enumerate(out):
            if t in stops:
                return out[:i]
        if stop_blk >= end:
            return out
        start = stop_blk
