"""The compiled CPU step against the eager one, step for step: the decode steps of real requests replayed.

The engine decodes `--tasks` held-out next lines under the model's default policy (batch 1) and keeps each decode
step's plan (its tokens, positions, segment and logit rows); then the same steps run through the eager forward
(`model(ids, positions, AttentionBatch)`, the path `ModelRunner` takes on the CPU) and through
`engine.compiled_step.CompiledStep` (every shape compiled before timing), in rounds that alternate the order,
and the median time per step of each, their ratio per round, and the largest logit difference are reported.
Prefill chunks are not in it (they stay eager). The end-to-end figure, tokens/s of whole requests against the
AR twin and llama.cpp, is bench/speculative.py --compiled.

    .venv/bin/python bench/compiled_step.py --model bench/models/unmask-tiny-5m-drafter --json F
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "bench/models/unmask-tiny-5m-drafter")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/corpus")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40, help="decode steps replayed (the first ones of the tasks)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from unmask.engine.compiled_step import MAX_WIDTH
    from unmask.engine.engine import Engine
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams
    from unmask.evaluation import next_line_tasks
    from unmask.models.attention import AttentionBatch
    from unmask.train.corpus import read_documents

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    # an engine that allocates caches as the compiled step needs them (one power-of-two buffer) and runs eagerly
    llm.engine = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=1, prefix_cache_bytes=0, compile_step=True)
    runner = llm.engine.runner
    step = runner.compiled
    if step is None:
        sys.exit(f"the compiled step does not take {args.model} in {args.dtype} (see the log)")
    step.enabled = False   # the capture runs eagerly (its caches still the compiled step's power-of-two buffers)
    captured = []
    execute = runner.execute

    def keep(plans):
        if max(p.segment.length for p in plans) <= MAX_WIDTH and len(captured) < args.steps:
            captured.append([(p.token_ids.clone(), p.positions.clone(), copy.copy(p.segment), p.logit_rows.clone())
                             for p in plans])
        return execute(plans)

    runner.execute = keep
    tasks = next_line_tasks(list(read_documents(args.corpus / "heldout.jsonl")), args.tasks)
    for t in tasks:
        llm.generate([llm.encode(t.prompt)], [GenerationParams(max_tokens=48, stop=list(t.stop),
                                                               min_tokens=t.min_tokens)])
    runner.execute = execute
    step.enabled = True

    def inputs(plan):
        for _, _, seg, _ in plan:       # replay from the step's own start: what it wrote then is scratch now
            seg.cache.length = seg.start
        ids = torch.cat([p[0] for p in plan])
        pos = torch.cat([p[1] for p in plan])
        return ids, pos, AttentionBatch([p[2] for p in plan]).prepare()

    def eager(plan):
        ids, pos, batch = inputs(plan)
        rows = torch.cat([p[3] for p in plan])
        return llm.model.logits(llm.model(ids, pos, batch)[rows])

    def compiled(plan):
        ids, pos, batch = inputs(plan)
        key = step.key(batch, [p[3].numel() for p in plan])
        out = step.run(key, ids, pos, batch, [p[3] for p in plan]) if key is not None else None
        if out is None:
            raise SystemExit(f"a captured step was not compiled: {key}")
        return out

    with torch.no_grad():
        t0 = time.perf_counter()
        diff = max((eager(p) - compiled(p)).abs().max().item() for p in captured)
        compile_s = time.perf_counter() - t0
        scale = max(eager(p).abs().max().item() for p in captured)
        per = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            order = [("eager", eager), ("compiled", compiled)]
            for name, f in (order if r % 2 == 0 else order[::-1]):
                t = time.perf_counter()
                for p in captured:
                    f(p)
                per[name].append((time.perf_counter() - t) / len(captured) * 1e3)
    ratios = [e / c for e, c in zip(per["eager"], per["compiled"])]
    widths = sorted({sum(p[2].length for p in plan) for plan in captured})
    doc = {"command": " ".join(sys.argv), "model": str(args.model), "dtype": args.dtype, "threads": args.threads,
           "steps": len(captured), "step_widths": widths, "shapes_compiled": step.compiles,
           "compile_s": compile_s, "max_logit_difference": diff, "logit_scale": scale,
           "ms_per_step": {k: {"median": statistics.median(v), "rounds": v} for k, v in per.items()},
           "speedup": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
    print(f"{len(captured)} decode steps of {args.tasks} next lines (tokens fed {widths[0]}-{widths[-1]}), "
          f"{step.compiles} shapes compiled in {compile_s:.0f} s; max |logit difference| {diff:.3f} "
          f"(logits up to {scale:.1f})")
    print(f"eager {doc['ms_per_step']['eager']['median']:.2f} ms/step, compiled "
          f"{doc['ms_per_step']['compiled']['median']:.2f} ms/step: x{doc['speedup']['median']:.2f} "
          f"[{doc['speedup']['min']:.2f}-{doc['speedup']['max']:.2f}]")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
