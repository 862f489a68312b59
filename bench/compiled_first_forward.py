"""A request's first forward (its prompt and first drafts) through the compiled CPU step against eagerly.

The time to first token of held-out next lines at batch 1 (max_tokens 1; `--max-tokens 48`: whole answers, to
the end of the line; bfloat16, the model's default policy),
with the compiled step taking a request alone up to `--width` tokens (MAX_WIDTH_ALONE: its prompt's forward
compiled) against up to 64 (decode steps only: the prompt's forward eager). Each side runs in a child process of
its own (the limit is read when a step is planned), without a prefix cache, 5 timed passes over the tasks after
an untimed one, in rounds that alternate the order; the median ms per request of each side and their ratio.

    .venv/bin/python bench/compiled_first_forward.py --model src/unmask/assets/unmask-tiny --json F
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> list[float]:
    import torch

    from unmask.engine import compiled_step
    from unmask.engine.engine import Engine
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams
    from unmask.evaluation import next_line_tasks
    from unmask.train.corpus import read_documents

    compiled_step.MAX_WIDTH_ALONE = args.limit
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="bfloat16", device="cpu")
    # no prefix cache: every pass feeds the whole prompt, as a request of a new file would
    llm.engine = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=1, prefix_cache_bytes=0, compile_step=True)
    tasks = next_line_tasks(list(read_documents(args.corpus / "heldout.jsonl")), args.tasks)
    prompts = [llm.encode(t.prompt) for t in tasks]
    params = [GenerationParams(max_tokens=args.max_tokens, stop=list(t.stop), min_tokens=min(t.min_tokens,
                                                                                         args.max_tokens))
              for t in tasks]
    for p, q in zip(prompts, params):   # untimed: oneDNN's packing, allocator warm-up
        llm.generate([p], [q])
    per_pass = []
    for _ in range(5):
        t0 = time.perf_counter()
        for p, q in zip(prompts, params):
            llm.generate([p], [q])
        per_pass.append((time.perf_counter() - t0) / len(prompts) * 1000)
    return per_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "src/unmask/assets/unmask-tiny")
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/corpus")
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--width", type=int, default=512, help="tokens a request alone may feed compiled")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=1, help="1: the first token; 48: whole answers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, help=argparse.SUPPRESS)   # the child's
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.limit:
        print(json.dumps(child(args)))
        return
    sides = {"eager_prompt": 64, "compiled_prompt": args.width}
    ms: dict[str, list[float]] = {n: [] for n in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            cmd = [sys.executable, __file__, "--limit", str(sides[name]), "--model", str(args.model),
                   "--corpus", str(args.corpus), "--tasks", str(args.tasks), "--threads", str(args.threads),
                   "--max-tokens", str(args.max_tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                sys.exit(f"{name}: {out.stderr.strip().splitlines()[-1]}")
            ms[name] += json.loads(out.stdout.strip().splitlines()[-1])
    med = {n: statistics.median(v) for n, v in ms.items()}
    ratio = med["eager_prompt"] / med["compiled_prompt"]
    print(f"ms per request, max_tokens {args.max_tokens} (median of {len(ms['eager_prompt'])} passes over "
          f"{args.tasks} prompts): prompt eager {med['eager_prompt']:.1f}, prompt compiled "
          f"{med['compiled_prompt']:.1f}: x{ratio:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "tasks": args.tasks,
                                         "max_tokens": args.max_tokens, "ms_per_request": ms,
                                         "median": med, "speedup": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()
