"""The compiled CPU step from a cold start: what a fresh engine costs before and while it meets its first requests.

Each mode runs in a process of its own (`--cache cold`: with an empty inductor cache, a first start on a new
machine; `warm`: the one a previous run left), builds the engine (timed: with the compiled step it compiles the
one-request step there), decodes the first `--tasks` held-out next lines one at a time (batch 1, the model's
default policy, bfloat16) timing every request, then decodes them again (the steady state). Modes: `eager` (no
compiled step) and `compiled`. Reported per mode: engine start, the first pass's total, median and slowest
request, compiles, the second pass's total and tokens/s, and each pass's outputs compared to eager's.

    .venv/bin/python bench/compiled_startup.py --model src/unmask/assets/unmask-tiny --json F
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchlib import line_children
from benchlib.common import write_json

MODES = ("eager", "compiled")


def one_mode(args) -> dict:
    """Runs in the child: every request of both passes, timed."""
    import torch

    from unmask.engine.llm import LLM

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16", device="cpu", compile_step=args.mode != "eager")
    start_s = time.perf_counter() - t0
    step = llm.engine.runner.compiled
    if args.mode != "eager" and step is None:
        sys.exit(f"the compiled step does not take {args.model} (see the log)")
    prompts, params = line_children.line_requests(llm, args, 48)
    passes = []
    for _ in range(2):
        seconds, outputs, tokens = [], [], 0
        for prompt, param in zip(prompts, params):
            t0 = time.perf_counter()
            out = llm.generate([prompt], [param])[0]
            seconds.append(time.perf_counter() - t0)
            outputs.append(out.token_ids)
            tokens += len(out.token_ids)
        passes.append({"seconds": seconds, "outputs": outputs, "tokens": tokens})
    doc = {"mode": args.mode, "start_s": start_s, "passes": passes}
    if step is not None:
        doc.update(shapes=step.compiles, compile_s=step.compile_s, compiled_steps=step.runs)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    line_children.add_args(ap)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold", help="inductor's on-disk cache")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)   # the child's
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(one_mode(args)))
        return

    results = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as cache:   # a cold inductor cache for every mode
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache} if args.cache == "cold" else dict(os.environ)
            results[mode] = line_children.run_child(__file__, args, ["--mode", mode], mode, env=env)
    reference = results.get("eager")
    rows = {}
    for mode, doc in results.items():
        first, second = doc["passes"]
        row = {"start_s": doc["start_s"], "first_pass_s": sum(first["seconds"]),
               "first_median_ms": 1000 * statistics.median(first["seconds"]),
               "first_slowest_s": max(first["seconds"]), "second_pass_s": sum(second["seconds"]),
               "second_tokens_per_s": second["tokens"] / sum(second["seconds"]),
               "shapes": doc.get("shapes", 0), "compile_s": doc.get("compile_s", 0.0)}
        if reference is not None:
            for i, name in ((0, "first"), (1, "second")):
                row[f"{name}_same_as_eager"] = sum(a == b for a, b in zip(doc["passes"][i]["outputs"],
                                                                         reference["passes"][0]["outputs"]))
        rows[mode] = row
        print(f"{mode:>10}: start {row['start_s']:.1f} s, first pass {row['first_pass_s']:.1f} s "
              f"(median {row['first_median_ms']:.0f} ms, slowest {row['first_slowest_s']:.2f} s), "
              f"{row['shapes']} compiles in {row['compile_s']:.1f} s; "
              f"second pass {row['second_pass_s']:.2f} s ({row['second_tokens_per_s']:.1f} tok/s)"
              + (f"; same as eager {row['first_same_as_eager']}/{row['second_same_as_eager']} of {args.tasks}"
                 if reference is not None else ""))
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "tasks": args.tasks, "cache": args.cache,
                               "modes": rows})


if __name__ == "__main__":
    main()
