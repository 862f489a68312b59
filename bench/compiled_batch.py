"""The compiled CPU step under concurrency: held-out next lines four at a time (LLM.generate over 4 prompts, so the
engine batches them and rows finish at different steps), eager against compiled, tokens/s in 3 alternating rounds
after an untimed warm-up pass that compiles the shapes it meets (at most the engine's cap of compiled graphs).

    .venv/bin/python bench/compiled_batch.py bench/models/unmask-tiny-5m-drafter
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run(llm, prompts, params, group: int) -> tuple[float, list]:
    """Tokens/s over every prompt, `group` requests per generate call, and the token ids written."""
    t0, tokens, outs = time.perf_counter(), 0, []
    for i in range(0, len(prompts), group):
        done = llm.generate(prompts[i:i + group], params[i:i + group])
        tokens += sum(len(o.token_ids) for o in done)
        outs += [o.token_ids for o in done]
    return tokens / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--group", type=int, default=4, help="requests decoded together")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/corpus")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from unmask.engine.engine import Engine
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams
    from unmask.evaluation import next_line_tasks
    from unmask.train.corpus import read_documents

    torch.set_num_threads(2)
    tasks = next_line_tasks(list(read_documents(args.corpus / "heldout.jsonl")), args.tasks)
    llms = {}
    for name, on in (("eager", False), ("compiled", True)):
        llm = LLM(args.model, dtype="bfloat16")
        llm.engine = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=2 * args.group, prefix_cache_bytes=0,
                            compile_step=on)
        llms[name] = llm
    prompts = [llms["eager"].encode(t.prompt) for t in tasks]
    params = [GenerationParams(max_tokens=48, stop=list(t.stop), min_tokens=t.min_tokens) for t in tasks]
    step = llms["compiled"].engine.runner.compiled
    t0 = time.perf_counter()
    run(llms["compiled"], prompts, params, args.group)
    warmup_s = time.perf_counter() - t0
    print(f"warm-up {warmup_s:.0f} s, shapes {step.compiles}")
    tps, outs = {"eager": [], "compiled": []}, {}
    for r in range(args.rounds):
        for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            speed, outs[name] = run(llms[name], prompts, params, args.group)
            tps[name].append(speed)
    ratios = [c / e for c, e in zip(tps["compiled"], tps["eager"])]
    same = sum(a == b for a, b in zip(outs["eager"], outs["compiled"]))
    print({n: [round(x, 1) for x in v] for n, v in tps.items()}, "ratio", [round(x, 2) for x in ratios])
    print("same outputs", same, len(prompts), "shapes", step.compiles, "compiled steps", step.runs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "warmup_s": warmup_s,
                                         "shapes": step.compiles, "compiled_steps": step.runs,
                                         "tokens_per_s": tps, "ratios": ratios, "same_outputs": same,
                                         "tasks": len(prompts)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
