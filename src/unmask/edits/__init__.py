"""Code edits by remasking: apply-edit (merge a lazy snippet) and next-edit (rewrite around the cursor).

Both turn a request into an `EditPlan` (plan.py): fixed text that is copied to the answer and the
few regions the model decides, each posed to the engine as an infill with everything else in view.
"""
from unmask.edits.apply import parse_apply_prompt, plan_merge
from unmask.edits.next_edit import parse_next_edit_prompt, plan_next_edit
from unmask.edits.plan import Choice, EditPlan, Fixed, Rewrite, choice_infill

__all__ = ["Choice", "EditPlan", "Fixed", "Rewrite", "choice_infill", "parse_apply_prompt", "plan_merge",
           "parse_next_edit_prompt", "plan_next_edit"]
