"""Where a `speculative` request's decoding steps go: per step, how many diffusion drafts it had, how many the
verifier kept, whether the copied chain won, and at the first refused diffusion draft whether the verifier's token
was the draft row's second or third choice. Instruments `SpeculativeSequence.apply` in this process only (the
output is unchanged); one task kind of the model card's held-out tasks under one eval policy.

    .venv/bin/python bench/speculative_steps.py --model bench/models/unmask-tiny-5m-drafter --kind 1 [--all]

--kind: 0 infills, 1 next lines, 2 function bodies; --all adds draft_all_outcomes. Writes --out (JSON per step).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import heldout  # noqa: E402
from unmask.engine import speculative as S  # noqa: E402
from unmask.evaluation import evaluate  # noqa: E402


def instrument(steps: list[dict]) -> None:
    """Record each decoding step of every SpeculativeSequence into `steps` (this process only)."""
    apply, next_drafts = S.SpeculativeSequence.apply, S.SpeculativeSequence._next_drafts

    def recording_next(self, logits, block, **kwargs):
        next_drafts(self, logits, block, **kwargs)
        self._top = None if block is None or block[1] == 0 else logits[block[0]:block[0] + block[1]].float().topk(
            3, -1).indices.cpu()  # the draft rows' top 3: was a refused draft's replacement a close second?

    def recording_apply(self, plan, logits):
        if plan.targets.numel() == 0:  # a write-only prefill chunk
            return apply(self, plan, logits)
        nd, k, top = int(self.drafts.numel()), self._k, getattr(self, "_top", None)
        kept, wins = self.kept, self.copy_wins
        chosen = logits[:k + 1].float().argmax(-1).cpu()
        start = self.final_end - self.P
        out = apply(self, plan, logits)
        rec = dict(f=start, nd=nd, k=k, alt=int(self._alt.numel()), a=self.kept - kept, won=self.copy_wins > wins)
        if top is not None and nd:
            j = 0
            while j < min(nd, k) and int(chosen[j]) == int(top[j, 0]):
                j += 1
            rec["refused"] = j if j < min(nd, k) else None
            if j < min(nd, k):
                rec["in_top2"] = int(chosen[j]) == int(top[j, 1])
                rec["in_top3"] = int(chosen[j]) in top[j, :3].tolist()
        steps.append(rec)
        return out

    S.SpeculativeSequence.apply, S.SpeculativeSequence._next_drafts = recording_apply, recording_next


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    heldout.add_args(ap)
    ap.add_argument("--kind", type=int, default=1, help="0 infills, 1 next lines, 2 function bodies")
    ap.add_argument("--policy", default="speculative_b4_lookup")
    ap.add_argument("--all", action="store_true", help="with draft_all_outcomes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm, _, tasks = heldout.load(args)
    steps: list[dict] = []
    instrument(steps)
    res = evaluate(llm, tasks[args.kind], args.policy, draft_all_outcomes=args.all or None)
    decoding = res.forwards - res.prefill_forwards
    print(f"{res.tokens} tokens, {decoding} decoding forwards: {res.tokens / decoding:.2f} tokens per forward")
    print("kept drafts per step:", sorted(collections.Counter(s["a"] for s in steps).items()))
    for nd in sorted({s["nd"] for s in steps}):
        x = [s for s in steps if s["nd"] == nd]
        print(f"steps with {nd} diffusion drafts: {len(x)}, kept {sum(s['a'] for s in x) / len(x):.2f} on average")
    print("first steps of an answer:", sum(s["f"] == 0 for s in steps), "; the copy won:", sum(s["won"] for s in steps))
    refused = [s for s in steps if s.get("refused") is not None]
    print("first refused diffusion draft at:", sorted(collections.Counter(s["refused"] for s in refused).items()),
          f"; the verifier's token was the draft row's 2nd choice {sum(s['in_top2'] for s in refused)}, "
          f"in its top 3 {sum(s['in_top3'] for s in refused)}, of {len(refused)}")
    Path(args.out or f"runs/speculative-steps-{args.kind}.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
