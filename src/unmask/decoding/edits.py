"""Decoding that revises committed tokens of the active block: token-to-token edits and remasking.

Two opt-in rules on top of a policy's mask-to-token commits (docs/decoding.md, "Editing committed tokens"):

- Edits, as LLaDA2.1 decodes (arXiv 2602.08676; SGLang's JointThreshold, diffusers' LLaDA2 pipeline): every step
  also reads the rows of the block's already-filled positions, and a position whose proposed token differs from
  the one it holds is replaced when that proposal's probability is above `edit_threshold` (strictly, as both
  references compare). Once the block has no mask left, up to `max_post_edit_steps` edit-only steps follow; the
  first that changes nothing ends the block.
- Remasking, ReMDM-style (arXiv 2503.00307): a filled position whose own token now has probability below
  `remask_threshold` is put back to mask, the least likely first, at most `remask_budget` per block, so that it
  is decoded again with what was committed since.

Which positions may be revised is the engine's to say (`editable`): filled positions of the active block only,
never a prompt token, and only before the first stop token committed there (the stop token itself stays). Edits
never write a stop token: an answer's end enters the canvas only through a mask commit, under the usual stop
rules. These are pure functions of the rows; the engine applies them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_POST_EDIT_STEPS = 16  # SGLang's JointThreshold default
DEFAULT_REMASK_THRESHOLD = 0.5


@dataclass(frozen=True)
class EditConfig:
    """A request's revision settings; `edit_threshold` None turns edits off, `remask_budget` 0 remasking."""

    edit_threshold: float | None = None
    max_post_edit_steps: int = DEFAULT_POST_EDIT_STEPS
    remask_budget: int = 0
    remask_threshold: float = DEFAULT_REMASK_THRESHOLD

    @property
    def active(self) -> bool:
        return self.edit_threshold is not None or self.remask_budget > 0


def edit_rows(current: Tensor, proposed: Tensor, probs: Tensor, editable: Tensor, edit_threshold: float | None,
              stops: Tensor) -> Tensor:
    """Bool [N]: the filled rows to replace by `proposed`: editable, a different token, p(proposed) above the
    threshold, and not a stop token. All [N] (rows of filled positions); `stops` a long tensor of stop ids."""
    if edit_threshold is None or current.numel() == 0:
        return torch.zeros_like(current, dtype=torch.bool)
    ok = editable & (proposed != current) & (probs > edit_threshold)
    if stops.numel():
        ok &= ~torch.isin(proposed, stops.to(proposed.device))
    return ok


def remask_rows(own_probs: Tensor, candidates: Tensor, remask_threshold: float, budget: int) -> Tensor:
    """Bool [N]: at most `budget` candidate rows whose own token's probability is below the threshold, the least
    likely first (ties to the lower row)."""
    low = candidates & (own_probs < remask_threshold)
    n = min(int(low.sum()), max(budget, 0))
    out = torch.zeros_like(low)
    if n:
        score = torch.where(low, own_probs.float(), torch.full_like(own_probs.float(), float("inf")))
        out[torch.sort(score, stable=True).indices[:n]] = True
    return out


def own_token_probs(logits: Tensor, current: Tensor) -> Tensor:
    """[N] float32: softmax(logits) at each row's current token."""
    if current.numel() == 0:
        return logits.new_zeros(0, dtype=torch.float32)
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, current.to(lp.device).unsqueeze(1)).squeeze(1).exp()


def block_settled(cfg: EditConfig, had_masks: bool, has_masks: bool, post_steps: int, changed: int) -> bool:
    """Whether the active block is final after this step.

    `had_masks` / `has_masks`: masks before the step's stop-capped region before / after it; `post_steps` the
    edit-only steps taken, this one included; `changed` the edits this step made. A block with masks is never
    final; the step that fills it ends it unless edits are on and post-edit steps are allowed; an edit-only step
    ends it when it changed nothing or was the last allowed."""
    if has_masks:
        return False
    if had_masks:
        return cfg.edit_threshold is None or cfg.max_post_edit_steps == 0
    return changed == 0 or post_steps >= cfg.max_post_edit_steps
