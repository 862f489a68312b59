"""The CPU forward with q/k/v and gate/up fused into one packed oneDNN product each and RoPE's cos/sin read from a
table (unmask.models.cpu_linear.FusedProjection, models.layers.Rotary), against the same model with separate
products and angles computed every forward: one LLM, toggled between tasks, batch 1, held-out next lines and
function bodies under the model's default policy, interleaved (A B, B A by task and round), tokens compared.

    .venv/bin/python bench/fused_projections.py --model src/unmask/assets/unmask-tiny --dtype auto --rounds 3 \
        --json docs/bench/cpu-linear/fused-builtin-auto.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "src/unmask/assets/unmask-tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--next-lines", type=int, default=30)
    ap.add_argument("--functions", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams
    from unmask.evaluation import function_tasks, next_line_tasks
    from unmask.models.cpu_linear import FUSED_GROUPS
    from unmask.train.corpus import read_documents

    llm = LLM(args.model, dtype=args.dtype)
    docs = list(read_documents(ROOT / "data/corpus/heldout.jsonl"))
    tasks = next_line_tasks(docs, args.next_lines) + function_tasks(docs, args.functions)
    prompts = [llm.encode(t.prompt) for t in tasks]
    groups = [(m, name, m.__dict__[name]) for m in llm.model.modules() for name in FUSED_GROUPS if name in m.__dict__]
    if not groups:
        sys.exit("no fused projections on this model (not on the CPU, oneDNN missing, or UNMASK_ONEDNN_LINEAR=0)")
    rope = llm.model.rope

    def use(fused: bool) -> None:
        for module, name, group in groups:
            if fused:
                module.__dict__[name] = group
            else:
                module.__dict__.pop(name, None)
        if fused:
            rope.__dict__.pop("cos_sin", None)
        else:   # the angles computed at every forward, as before the table
            rope.cos_sin = lambda positions, sync_free=False: rope._angles(positions)

    def one(i: int, fused: bool):
        use(fused)
        t = tasks[i]
        gp = GenerationParams(max_tokens=64, stop=list(t.stop), min_tokens=t.min_tokens)
        t0 = time.perf_counter()
        out = llm.generate([prompts[i]], [gp])[0]
        return time.perf_counter() - t0, out.token_ids, out.forwards

    for i in range(len(tasks)):   # warm-up, untimed: each path once per task
        one(i, True)
        one(i, False)
    kinds = sorted({t.kind for t in tasks})
    rounds, same = [], True
    for r in range(args.rounds):
        tally = {(k, f): [0.0, 0, 0] for k in kinds for f in (True, False)}   # seconds, tokens, forwards
        for i, t in enumerate(tasks):
            got = {}
            for fused in ((True, False) if (i + r) % 2 == 0 else (False, True)):
                sec, ids, fwd = one(i, fused)
                cell = tally[(t.kind, fused)]
                cell[0] += sec
                cell[1] += len(ids)
                cell[2] += fwd
                got[fused] = ids
            same &= got[True] == got[False]
        rounds.append(tally)
        print(f"round {r + 1}: " + ", ".join(
            f"{k} x{(tally[(k, False)][0] / tally[(k, True)][0]):.3f}" for k in kinds), flush=True)
    use(True)
    report = {"command": "bench/fused_projections.py " + " ".join(sys.argv[1:]), "model": str(args.model),
              "dtype": str(llm.model.lm_head.weight.dtype).replace("torch.", ""), "threads": args.threads,
              "load_average": list(os.getloadavg()), "same_tokens": same, "kinds": {}}
    for k in kinds:
        ratios = [t[(k, False)][0] / t[(k, True)][0] for t in rounds]
        tps = {f: statistics.median(t[(k, f)][1] / t[(k, f)][0] for t in rounds) for f in (True, False)}
        ms = {f: statistics.median(1e3 * t[(k, f)][0] / t[(k, f)][2] for t in rounds) for f in (True, False)}
        report["kinds"][k] = {"tasks": sum(t.kind == k for t in tasks), "tokens_per_s": {"fused": tps[True],
                              "separate": tps[False]}, "ms_per_forward": {"fused": ms[True], "separate": ms[False]},
                              "speed_up": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
        print(f"{k:10} separate {tps[False]:6.1f} tok/s ({ms[False]:.2f} ms/forward)  fused {tps[True]:6.1f} tok/s "
              f"({ms[True]:.2f} ms/forward)  x{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    print(f"same tokens: {same}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
