"""Stop tokens in order (`ordered_stops`) against the old commit order, on held-out tasks, interleaved A B A B.

Reports, for each setting: empty fill-in-the-middle answers over the held-out FIM records (line and block
spans, through the engine's own FIM prompt), and the model card's held-out infill / next-line / function-body
scores under the default policy (threshold 0.9), with tokens per forward. Writes one JSON document.

    .venv/bin/python bench/ordered_stops.py --model src/unmask/assets/unmask-tiny --out docs/bench/ordered-stops.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchlib import heldout
from benchlib.common import write_json
from unmask.engine.infill import build_infill
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.evaluation import evaluate

SETTINGS = {"ordered": True, "any_order": False}


def fim_empties(llm: LLM, records: list[dict], ordered: bool, max_tokens: int = 32) -> dict:
    prompts = [build_infill(llm.tokenizer, llm.spec, r["fim"]["prefix"], r["fim"]["suffix"],
                            llm.spec.max_context - max_tokens).prompt_ids for r in records]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, GenerationParams(max_tokens=max_tokens, ordered_stops=ordered))
    return {"n": len(outs), "empty": sum(not o.text.strip() for o in outs),
            "tokens_per_forward": sum(len(o.token_ids) for o in outs) / max(sum(o.forwards for o in outs), 1),
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    heldout.add_args(ap)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("docs/bench/ordered-stops.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm, records, task_sets = heldout.load(args)
    fims = [r for r in records if r.get("kind") == "fim"]
    rows: dict[str, dict[str, list]] = {name: {} for name in SETTINGS}
    for _ in range(args.rounds):
        for name, ordered in SETTINGS.items():   # interleaved: A B A B
            rows[name].setdefault("fim", []).append(fim_empties(llm, fims, ordered))
            for tasks in task_sets:
                r = evaluate(llm, tasks, "threshold_0.9", ordered_stops=ordered)
                rows[name].setdefault(r.task, []).append(
                    {"exact": r.accuracy, "similarity": r.edit_similarity, "valid": r.valid, "n": r.n,
                     "tokens_per_forward": r.tokens_per_forward, "seconds": r.seconds})
    summary = {}
    for name, by_task in rows.items():
        summary[name] = {}
        for task, runs in by_task.items():
            first = dict(runs[0])   # greedy: every round gives the same answers; only the seconds vary
            first["seconds"] = statistics.median(r["seconds"] for r in runs)
            summary[name][task] = first
    doc = {"model": args.model, "policy": "threshold_0.9", "rounds": args.rounds, "results": summary}
    write_json(args.out, doc)
    for name, by_task in summary.items():
        for task, r in by_task.items():
            print(name, task, json.dumps(r))


if __name__ == "__main__":
    main()
