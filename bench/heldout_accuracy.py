"""Held-out accuracy of unmask's default decoding against the AR twin on every held-out next line, not only the
model card's 5% sample: is "equal accuracy" a tie or a loss once the sample is large enough to tell?

The model card (and bench/speculative.py's twin comparison) scores 133 next lines (hash-sampled at 5% of the
eligible lines of the held-out stdlib files) and 59 single-line infills; one task of 192 is then half a point.
Here every eligible line is a task (2,543 on this corpus: the card's 133 and the 2,410 others, reported apart),
each decoded greedily at batch 1 by every unmask model (under the policy its generation_config.json makes the
default, or --policy) and by the twin through transformers `generate`. Per set: exact match with its Wilson 95%
interval, mean edit similarity, and the paired comparison against the twin (tasks only one side gets right;
two-sided exact binomial p over those, McNemar's test). Accuracy only: nothing here is timed (bench/speculative.py
measures the speed on the same models).

    .venv/bin/python bench/heldout_accuracy.py --dtype bfloat16 --json docs/bench/heldout-accuracy-5m-bf16.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
MAX_TOKENS = 48   # benchlib.policies' cap for one-line answers


def binomial_two_sided(k: int, n: int) -> float:
    """P(as or more extreme than k of n discordant pairs) under p = 1/2."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def score(tasks, answers: list[str]) -> dict:
    from benchlib.common import wilson
    from unmask.evaluation import edit_similarity

    right = [a == t.target for a, t in zip(answers, tasks)]
    sims = [edit_similarity(a, t.target) for a, t in zip(answers, tasks)]
    k, n = sum(right), len(tasks)
    return {"n": n, "correct": k, "accuracy": k / max(n, 1), "ci95": list(wilson(k, n)),
            "edit_similarity": sum(sims) / max(n, 1), "right": right}


def paired(a: list[bool], b: list[bool]) -> dict:
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    return {"only_this": only_a, "only_twin": only_b, "both": sum(x and y for x, y in zip(a, b)),
            "mcnemar_p": binomial_two_sided(only_a, only_a + only_b)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bench/models/unmask-tiny-5m,bench/models/unmask-tiny-5m-drafter",
                    help="comma-separated unmask model directories")
    ap.add_argument("--policy", default=None, help="a policy name for every model instead of each one's default")
    ap.add_argument("--twin", type=Path, default=ROOT / "bench/models/ar-twin")
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/corpus")
    ap.add_argument("--sft-heldout", type=Path, default=ROOT / "data/sft/heldout.jsonl")
    ap.add_argument("--rate", type=float, default=1.0, help="share of the eligible next lines to score (card: 0.05)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many tasks per set (a quick run)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from benchlib.twin import HFTwin
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams, model_policy
    from unmask.evaluation import infill_tasks, next_line_tasks
    from unmask.train.corpus import read_documents
    from unmask.train.instructions import read_jsonl

    docs = list(read_documents(args.corpus / "heldout.jsonl"))
    card = next_line_tasks(docs, 10 ** 9)
    card_keys = {(t.prompt, t.target) for t in card}
    others = [t for t in next_line_tasks(docs, 10 ** 9, rate=args.rate) if (t.prompt, t.target) not in card_keys]
    sets = {"next_line_card": card, "next_line_others": others,
            "infill": infill_tasks(read_jsonl(args.sft_heldout), 10 ** 9) if args.sft_heldout.is_file() else []}
    if args.limit:
        sets = {k: v[:args.limit] for k, v in sets.items()}
    twin = HFTwin(args.twin, dtype=args.dtype)
    report = {"command": "bench/heldout_accuracy.py " + " ".join(sys.argv[1:]), "dtype": args.dtype,
              "threads": torch.get_num_threads(), "max_tokens": MAX_TOKENS, "sets": {k: len(v) for k, v in sets.items()},
              "twin": str(args.twin), "models": {}}

    def run_twin(tasks, prompts) -> list[str]:
        return [t.answer(twin.run(p, MAX_TOKENS, stop_newline="\n" in t.stop, min_tokens=t.min_tokens).text)
                for t, p in zip(tasks, prompts)]

    decoders = {"ar_twin_generate": run_twin}
    llms = []
    for path in [p.strip() for p in args.models.split(",") if p.strip()]:
        llm = LLM(Path(path), dtype=args.dtype)
        llms.append(llm)
        knobs = {"policy": args.policy} if args.policy else {}

        def run(tasks, prompts, llm=llm, knobs=knobs) -> list[str]:
            out = []
            for t, p in zip(tasks, prompts):
                gp = GenerationParams(max_tokens=MAX_TOKENS, stop=list(t.stop), min_tokens=t.min_tokens, **knobs)
                out.append(t.answer(llm.generate([p], [gp])[0].text))
            return out

        policy = args.policy or json.dumps(model_policy(llm.spec.generation_config) or {"policy": "threshold"})
        decoders[f"{Path(path).name} {policy}"] = run
    results = {name: {} for name in decoders}
    for set_name, tasks in sets.items():
        prompts = [llms[0].encode(t.prompt) for t in tasks]   # one tokenizer for all (the twin's is the same)
        for name, decode in decoders.items():
            t0 = time.perf_counter()
            answers = decode(tasks, prompts)
            results[name][set_name] = score(tasks, answers)
            r = results[name][set_name]
            print(f"{set_name:18} {name:42} {r['correct']:5d}/{r['n']:<5d} {100 * r['accuracy']:5.1f}% "
                  f"sim {r['edit_similarity']:.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, by_set in results.items():
        entry = {}
        for set_name, r in by_set.items():
            entry[set_name] = {k: v for k, v in r.items() if k != "right"}
            if name != "ar_twin_generate":
                entry[set_name]["vs_twin"] = paired(r["right"], results["ar_twin_generate"][set_name]["right"])
        all_right = [x for r in by_set.values() for x in r["right"]]
        entry["all"] = {"n": len(all_right), "correct": sum(all_right), "accuracy": sum(all_right) / max(len(all_right), 1)}
        if name != "ar_twin_generate":
            twin_all = [x for r in results["ar_twin_generate"].values() for x in r["right"]]
            entry["all"]["vs_twin"] = paired(all_right, twin_all)
        report["models"][name] = entry
    for name, entry in report["models"].items():
        v = entry["all"].get("vs_twin")
        print(f"all sets: {name:42} {entry['all']['correct']}/{entry['all']['n']}"
              + (f"  only this {v['only_this']}, only twin {v['only_twin']}, McNemar p {v['mcnemar_p']:.3f}" if v else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
