"""Editing committed tokens (docs/decoding.md, "Editing committed tokens") against the same threshold without
edits, on the model card's held-out tasks: quality and tokens per forward, threshold by threshold.

The claim to test (issue 35): a model that may fix its mistakes can commit earlier, at a lower threshold, for
the same quality. Each threshold runs plain (unless `--no-plain`), with each `--edit-thresholds` value (LLaDA2.1's
joint decoding) at each `--post-edit-steps` value and, with `--remask-budget` > 0, with ReMDM-style remasking, in
one process, interleaved. Greedy, float32; one JSON
document out, rewritten after every row (so a run cut short keeps what it measured), with the command line and the
load average at the start and the end (each row also in the output as it comes).

    .venv/bin/python bench/edit_policies.py --model src/unmask/assets/unmask-tiny --json docs/bench/edit-policies.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchlib import heldout
from benchlib.common import write_json
from unmask.evaluation import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    heldout.add_args(ap)
    ap.add_argument("--thresholds", default="0.9,0.7,0.5")
    ap.add_argument("--edit-thresholds", "--edit-threshold", default="0.9", help="comma-separated edit thresholds")
    ap.add_argument("--post-edit-steps", default="16",
                    help="comma-separated max_post_edit_steps, each run with each edit threshold (0: edits only "
                         "while the block has masks, no forward added)")
    ap.add_argument("--no-plain", action="store_true", help="skip the runs without edits (rows measured before)")
    ap.add_argument("--remask-budget", type=int, default=0, help="> 0: also remasking, this many per block")
    ap.add_argument("--remask-threshold", type=float, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    llm, _, task_sets = heldout.load(args)
    rows = []
    doc = {"model": args.model, "command": " ".join(sys.argv), "loadavg_start": os.getloadavg(), "rows": rows}

    def write() -> None:
        if args.json:
            write_json(args.json, {**doc, "loadavg_now": os.getloadavg()})

    variants = [] if args.no_plain else [dict()]
    variants += [dict(edit_threshold=float(e), max_post_edit_steps=int(k))
                 for e in args.edit_thresholds.split(",") if e for k in args.post_edit_steps.split(",")]
    if args.remask_budget > 0:
        variants.append(dict(remask_budget=args.remask_budget, remask_threshold=args.remask_threshold))
    for tau in (float(t) for t in args.thresholds.split(",")):
        for knobs in variants:
            for tasks in task_sets:
                r = evaluate(llm, tasks, "threshold_0.9", threshold=tau, **knobs)
                row = {"threshold": tau, "edit_threshold": knobs.get("edit_threshold"),
                       "max_post_edit_steps": knobs.get("max_post_edit_steps"),
                       "remask_budget": knobs.get("remask_budget"), "task": r.task, "n": r.n, "exact": r.accuracy,
                       "similarity": r.edit_similarity, "valid": r.valid,
                       "tokens_per_forward": r.tokens_per_forward, "seconds": r.seconds}
                rows.append(row)
                print(json.dumps(row), flush=True)
                write()


if __name__ == "__main__":
    main()
