"""Which masked positions of the active block a step hands to the policy.

Two restrictions on top of "every masked position of the block", both pure functions of the canvas:

- Sub-blocks (Fast-dLLM v2, arXiv 2509.26328): with `sub` set, only the leftmost `sub`-sized slice of the block
  that still holds a mask is decoded; the rest of the block is still fed to the model, just not targeted.
- Early stop: positions after a stop token already committed in the block are not decoded any more; only the
  holes before it are, since the output ends at the first stop token whatever follows it.

And one restriction on what a step commits (`ordered_stops`): a stop token is committed only at the first
undecided position. Models trained with EOS padding in the loss (the LLaDA / SDAR SFT recipe, and the built-in
family) are most confident of EOS on the tail of a masked block; committed there first, it pulls the answer's
end forward (an infill of "def area(r):" that comes back empty). Deferred, the tail stays masked until the
text before it is written; it is never banned, so an answer still ends the step its end is the leftmost hole.
"""
from __future__ import annotations

import torch
from torch import Tensor


def decode_window(seq: Tensor, block_start: int, block_end: int, mask_id: int, sub: int | None) -> tuple[int, int]:
    """[lo, hi) the policy may target: the block, or with `sub` its leftmost sub-block that still has a mask.

    Sub-blocks are aligned to `block_start` (the block size is a multiple of `sub`); a block with no mask left
    gives its last sub-block, whose targets are then empty.
    """
    if sub is None:
        return block_start, block_end
    holes = (seq[block_start:block_end] == mask_id).nonzero()
    first = int(holes[0]) if holes.numel() else block_end - block_start - 1
    lo = block_start + first // sub * sub
    return lo, min(lo + sub, block_end)


def first_stop(seq: Tensor, start: int, end: int, stops: Tensor) -> int:
    """The first position in [start, end) that holds one of `stops` (a long tensor), or `end` if none does."""
    if stops.numel() == 0 or start >= end:
        return end
    hits = torch.isin(seq[start:end], stops).nonzero()
    return start + int(hits[0]) if hits.numel() else end


def masked_in(seq: Tensor, lo: int, hi: int, mask_id: int) -> Tensor:
    """Absolute positions in [lo, hi) that are still masked, ascending."""
    return (seq[lo:hi] == mask_id).nonzero(as_tuple=True)[0] + lo


def defer_late_stops(commit: Tensor, tokens: Tensor, targets: Tensor, first_hole: int, stops: Tensor) -> Tensor:
    """`commit` without the stop tokens proposed right of `first_hole` (the first undecided position); if that
    leaves nothing, the leftmost target (whatever it holds) so a step always commits. All [M] but `first_hole`."""
    late = torch.isin(tokens, stops) & commit & (targets != first_hole)
    if not bool(late.any()):
        return commit
    kept = commit & ~late
    if not bool(kept.any()):
        kept[int(targets.argmin())] = True
    return kept
