"""The steps of a request that revises committed tokens of its active block (docs/decoding.md, "Editing committed
tokens"): which positions may change, the extra row a shifted family needs for its block's first position, and the
step that commits, edits and remasks. The rules themselves are pure functions in `unmask.decoding.edits`; this is
their bookkeeping on a `Sequence` (engine/sequence.py), which mixes this class in.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from unmask.decoding.edits import block_settled, edit_rows, own_token_probs, remask_rows
from unmask.decoding.sampling import propose
from unmask.decoding.targets import first_stop

if TYPE_CHECKING:
    from unmask.engine.sequence import StepPlan


class RevisingSteps:
    """Sequence methods for `revise` (an active `EditConfig`); they read and write the Sequence's state."""

    @property
    def _first_row_fixed(self) -> bool:
        """Whether the block's first position is predicted by a row that sees nothing of the block: a shifted
        block-causal family reads it from the last row before the block, whose attention stops at that row."""
        return self.traits.shift and not self.bidirectional

    def editable_positions(self) -> Tensor:
        """Filled positions of the active block that edits / remasks may change, ascending: never a prompt token,
        never outside the block (its K/V are not written until it is settled, so the cache stays exact), and only
        before the first stop token committed in it (which stays, so the output's end is never undone)."""
        lo, hi = max(self.block_start, self.P), self.block_end
        stop = first_stop(self.seq, self.final_end, min(hi, self.end), self.stop_tensor)
        hi = min(hi, stop) if stop < min(hi, self.end) else hi
        if lo >= hi:
            return torch.empty(0, dtype=torch.long)
        return (self.seq[lo:hi] != self.traits.mask_id).nonzero(as_tuple=True)[0] + lo

    def _with_editable(self, targets: Tensor) -> Tensor:
        if self.revise is None:
            return targets
        return torch.sort(torch.cat([targets, self.editable_positions()])).values

    def _with_first_row(self, plan: StepPlan, logits: Tensor) -> tuple[StepPlan, Tensor]:
        """Revising on a shifted block-causal family: the row that predicts the block's first position (the one
        before the block) is computed only by the block's first forward; later forwards start at the block, whose
        first row predicts its second position. That row attends to nothing of the block, so its logits are the
        same at every step of the block: kept (unadjusted) from that forward, they are read again with the other
        filled positions so that edits reach the first position too. Returns the plan and logits with that row
        first where the position is editable."""
        first = self.block_start
        if first < self.P:  # a prompt token: never revised
            return plan, logits
        if plan.targets.numel() and int(plan.targets[0]) == first:
            self.first_row = logits[0].detach().clone()
            return plan, logits
        editable = self.editable_positions()
        if self.first_row is None or not editable.numel() or int(editable[0]) != first:
            return plan, logits
        at = torch.tensor([first])
        plan = replace(plan, targets=torch.cat([at, plan.targets]),
                       logit_rows=torch.cat([torch.tensor([-1]), plan.logit_rows]))  # -1: no row of this forward
        row = self.first_row[None]
        if not plan.targets.numel() - 1:  # a forward that read no row (the rest of the block is past a stop)
            return plan, row.clone()
        return plan, torch.cat([row.to(logits.device, logits.dtype), logits])

    def _apply_revising(self, plan: StepPlan, logits: Tensor) -> list[int]:
        """A step with edits or remasking (unmask.decoding.edits): the policy commits among the masked rows as
        usual; the filled rows may be replaced (edits) or put back to mask (remasks); the block's tokens become
        final only once it is settled."""
        mask = self.traits.mask_id
        masked = self.seq[plan.targets] == mask
        m_targets, f_targets = plan.targets[masked], plan.targets[~masked]
        m_logits, f_logits = logits[masked.to(logits.device)], logits[(~masked).to(logits.device)]
        had_masks = m_targets.numel() > 0
        commit = torch.zeros(0, dtype=torch.bool)
        if had_masks:
            d, commit = self._choose(m_logits, m_targets, int(m_targets[0]))
        current = self.seq[f_targets]
        replace_ = remask = torch.zeros(f_targets.numel(), dtype=torch.bool)
        if f_targets.numel():
            prop = propose(f_logits.float(), self.sampling, self.generator)
            editable = torch.ones_like(replace_)
            replace_ = edit_rows(current, prop.tokens.cpu(), prop.probs.cpu(), editable, self.revise.edit_threshold,
                                 self.stop_tensor)
            if had_masks and self.remask_left:  # remasking only while the block is still being filled
                own = own_token_probs(f_logits, current).cpu()
                candidates = ~replace_
                if self._first_row_fixed:  # its row never sees the block: decoded again, it would read the same row
                    candidates &= f_targets != self.block_start
                remask = remask_rows(own, candidates, self.revise.remask_threshold, self.remask_left)
                self.remask_left -= int(remask.sum())
        if had_masks:
            pos = m_targets[commit]
            self.seq[pos] = d.tokens[commit].cpu()
            self._record(pos, d.tokens[commit], d.probs[commit], m_logits[commit.to(m_logits.device)])
        if self.adjuster is not None:  # the penalties count what the text holds: out go the replaced and remasked
            self.adjuster.withdraw(current[replace_ | remask])
        if bool(replace_.any()):
            pos = f_targets[replace_]
            self.seq[pos] = prop.tokens.cpu()[replace_]
            self._record(pos, prop.tokens.cpu()[replace_], prop.probs.cpu()[replace_],
                         f_logits[replace_.to(f_logits.device)])
        self.seq[f_targets[remask]] = mask
        n_edit, n_remask = int(replace_.sum()), int(remask.sum())
        self.stats.edits += n_edit
        self.stats.remasks += n_remask
        self.edited = (f_targets[replace_ | remask] - self.P).tolist()
        if bool(commit.any()) or n_edit or n_remask:
            self.stats.denoise_steps += 1
        has_masks = self._holes_before_stop()
        if not had_masks:
            self.post_edit_steps += 1
        self.settled = block_settled(self.revise, had_masks, has_masks, self.post_edit_steps, n_edit)
        return self._advance()

    def _holes_before_stop(self) -> bool:
        """Whether the active block still has a mask in the output before its first committed stop token."""
        hi = min(self.block_end, self.end)
        hi = first_stop(self.seq, self.final_end, hi, self.stop_tensor)
        return bool((self.seq[self.block_start:hi] == self.traits.mask_id).any())
