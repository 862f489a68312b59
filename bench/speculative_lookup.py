"""Prompt-lookup drafts (`draft_lookup`) under the `speculative` policy: tokens per forward and tokens/s with and
without them, interleaved (A B, then B A), on the model card's held-out function bodies and next lines, batch 1.

The output is the same either way (tests/test_draft_lookup.py); only the number of forwards and their width
change, so this measures speed alone. Ratios are taken within each round; medians with min-max over rounds.

    .venv/bin/python bench/speculative_lookup.py --tasks 20 --rounds 3 --json docs/bench/speculative/lookup.json

`--baseline-single-chain` compares, at the same `--lookup` on both sides, the copy verified beside diffusion
drafts it disagrees with (engine/speculative.py, "a second chain") against the single chain the engine ran
before it (the copy only continuing the diffusion drafts): the baseline runs with that second chain switched
off in the process, the candidate as the engine runs. `--all-outcomes` compares, at the same `--lookup`,
draft blocks after every count of kept diffusion drafts (`draft_all_outcomes`) against one after all drafts.
`--baseline-model B` compares `--model` against B under the same settings (a draft adapter against its base:
the output is the same, the drafts are not). `--baseline-plain-linear` compares, same model and settings, the
CPU linears through oneDNN on packed weights (models/cpu_linear.py, what `LLM` does) against torch's default
`F.linear` (a second copy of the model loaded with UNMASK_ONEDNN_LINEAR=0); `--policy threshold` runs that
comparison under the threshold rule instead of `speculative`. `--baseline-no-ngrams` compares, at the same
`--lookup`, drafts from the model's n-gram table where the copy finds nothing (`draft_ngrams`, the default where
the model ships `ngram_drafts.safetensors`) against the same requests with `draft_ngrams: false`;
`--baseline-no-table-chain` compares the table's draft verified as a second chain in steps without diffusion
drafts against the engine without that (the baseline patches `_second_chain` in this process);
`--baseline-table-block-after-all` compares a table-only step's draft block placed after none of its drafts
against the placement before it, after all of them (the baseline patches `_outcomes` in this process).
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


_SECOND_CHAIN = []  # the engine's own method, kept on first use
_OUTCOMES = []      # likewise


def _no_second_chain(self, f, drafts):
    return drafts[:0]


def _no_table_chain(self, f, drafts):
    """The second chain as before 2026-12-06 evening: only beside diffusion drafts (no table chain in steps
    without them)."""
    if not min(int(self.drafts.numel()), int(drafts.numel())):
        return drafts[:0]
    return _SECOND_CHAIN[0](self, f, drafts)


def _block_after_all(self, k):
    """The draft block's placement before 2026-12-06 evening: after all drafts, the table's too."""
    return [k] if not self.all_outcomes else _OUTCOMES[0](self, k)


def run(llm, prompts, tasks, max_tokens: int, knobs: dict, outputs: list | None = None) -> tuple[int, int, float]:
    from unmask.engine.params import GenerationParams
    from unmask.engine.speculative import SpeculativeSequence

    if not _SECOND_CHAIN:
        _SECOND_CHAIN.append(SpeculativeSequence._second_chain)
        _OUTCOMES.append(SpeculativeSequence._outcomes)
    knobs = dict(knobs)
    # the baseline: the engine's own code with its second chain off (no copy verified beside the drafts)
    single, no_table = knobs.pop("single_chain", False), knobs.pop("no_table_chain", False)
    SpeculativeSequence._second_chain = (_no_second_chain if single else _no_table_chain if no_table
                                         else _SECOND_CHAIN[0])
    SpeculativeSequence._outcomes = _block_after_all if knobs.pop("table_block_after_all", False) else _OUTCOMES[0]

    cache = getattr(llm.engine, "prefix_cache", None)
    if cache is not None:  # every run pays its own prefills (a cache warmed by the run before would flatter it)
        cache.clear()
    tokens = forwards = 0
    t0 = time.perf_counter()
    for p, t in zip(prompts, tasks):
        gp = GenerationParams(max_tokens=max_tokens, stop=list(t.stop), min_tokens=t.min_tokens, **knobs)
        out = llm.generate([p], [gp])[0]
        tokens, forwards = tokens + len(out.token_ids), forwards + out.forwards
        if outputs is not None:
            outputs.append(list(out.token_ids))
    return tokens, forwards, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "src/unmask/assets/unmask-tiny")
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/corpus")
    ap.add_argument("--tasks", type=int, default=20, help="tasks per kind")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--baseline-lookup", type=int, default=0,
                    help="the lookup count the run compares against (0: no lookup; e.g. 8 to try --lookup 16)")
    ap.add_argument("--baseline-single-chain", action="store_true",
                    help="baseline: the same --lookup without the copy verified as a second chain")
    ap.add_argument("--all-outcomes", action="store_true",
                    help="candidate: the same --lookup with a draft block after every count of kept diffusion "
                         "drafts (draft_all_outcomes); baseline: the same --lookup without it")
    ap.add_argument("--baseline-model", type=Path, default=None,
                    help="baseline: this model (e.g. the base of a draft adapter) with the candidate's settings; "
                         "candidate: --model")
    ap.add_argument("--baseline-plain-linear", action="store_true",
                    help="baseline: the same model and settings with torch's default F.linear instead of oneDNN "
                         "on packed weights")
    ap.add_argument("--baseline-no-table-chain", action="store_true",
                    help="baseline: the same settings with the n-gram table's draft not verified as a second chain "
                         "in steps without diffusion drafts (the engine before that)")
    ap.add_argument("--baseline-table-block-after-all", action="store_true",
                    help="baseline: the same settings with a table-only step's draft block after all its drafts "
                         "(the engine before it went after none)")
    ap.add_argument("--baseline-no-ngrams", action="store_true",
                    help="baseline: the same --lookup with draft_ngrams false (the model's n-gram table unused)")
    ap.add_argument("--policy", choices=("speculative", "threshold"), default="speculative",
                    help="threshold (0.9, --block-size): only with --baseline-plain-linear")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from unmask.engine.llm import LLM
    from unmask.evaluation import FUNCTION_TOKENS, function_tasks, next_line_tasks
    from unmask.train.corpus import read_documents

    torch.set_num_threads(args.threads)
    if args.policy != "speculative" and not args.baseline_plain_linear:
        raise SystemExit("--policy threshold compares only linears (--baseline-plain-linear)")
    llm = LLM(args.model, dtype=args.dtype)
    llms = {"without": LLM(args.baseline_model, dtype=args.dtype) if args.baseline_model else llm, "with": llm}
    if args.baseline_plain_linear:
        os.environ["UNMASK_ONEDNN_LINEAR"] = "0"
        llms["without"] = LLM(args.model, dtype=args.dtype)
        del os.environ["UNMASK_ONEDNN_LINEAR"]
        if not llm.packed_linears or llms["without"].packed_linears:
            raise SystemExit("--baseline-plain-linear: oneDNN's packed linear is not available here")
    docs = list(read_documents(args.corpus / "heldout.jsonl"))
    kinds = {"function": (function_tasks(docs, args.tasks), FUNCTION_TOKENS),
             "next_line": (next_line_tasks(docs, args.tasks), 48)}
    base = dict(policy="speculative", block_size=args.block_size)
    # "without" is the baseline (--baseline-lookup, no lookup by default), "with" the candidate (--lookup)
    variants = {"without": {**base, "draft_lookup": args.baseline_lookup},
                "with": {**base, "draft_lookup": args.lookup}}
    if args.baseline_single_chain:
        variants["without"] = {**base, "draft_lookup": args.lookup, "single_chain": True}
    if args.all_outcomes:
        variants = {"without": {**base, "draft_lookup": args.lookup},
                    "with": {**base, "draft_lookup": args.lookup, "draft_all_outcomes": True}}
    if args.baseline_no_ngrams:
        if llm.engine.traits.ngram_drafts is None:
            raise SystemExit(f"--baseline-no-ngrams: {args.model} has no ngram_drafts.safetensors")
        variants = {"without": {**base, "draft_lookup": args.lookup, "draft_ngrams": False},
                    "with": {**base, "draft_lookup": args.lookup}}
    if args.baseline_no_table_chain:
        variants = {"without": {**base, "draft_lookup": args.lookup, "no_table_chain": True},
                    "with": {**base, "draft_lookup": args.lookup}}
    if args.baseline_table_block_after_all:
        variants = {"without": {**base, "draft_lookup": args.lookup, "table_block_after_all": True},
                    "with": {**base, "draft_lookup": args.lookup}}
    if args.baseline_model or args.baseline_plain_linear:  # the same settings on both: weights or linears differ
        variants["without"] = dict(variants["with"])
    if args.policy == "threshold":
        variants = {v: dict(policy="threshold", threshold=0.9, block_size=args.block_size) for v in variants}
    doc = {"command": " ".join(sys.argv), "model": str(args.model), "threads": args.threads,
           "baseline_model": str(args.baseline_model) if args.baseline_model else None,
           "baseline_plain_linear": args.baseline_plain_linear, "dtype": args.dtype,
           "variants": {v: dict(knobs) for v, knobs in variants.items()},
           "lookup": {"without": args.baseline_lookup, "with": args.lookup},
           "load_average_start": os.getloadavg(), "kinds": {}}
    for kind, (tasks, max_tokens) in kinds.items():
        prompts = [llm.encode(t.prompt) for t in tasks]
        rows = {v: [] for v in variants}
        outputs = {v: [] for v in variants}
        for v in variants:  # warm-up: the first run of a kind pays for allocations the others reuse
            run(llms[v], prompts[:2], tasks[:2], max_tokens, variants[v])
        for r in range(args.rounds):
            for v in (variants if r % 2 == 0 else reversed(list(variants))):
                outputs[v] = []
                tokens, forwards, seconds = run(llms[v], prompts, tasks, max_tokens, variants[v], outputs[v])
                rows[v].append({"tokens": tokens, "forwards": forwards, "seconds": seconds})
                print(f"{kind} round {r} {v:8} {tokens / forwards:.2f} tok/fwd {tokens / seconds:7.1f} tok/s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
        ratios = [w["tokens"] / w["seconds"] / (o["tokens"] / o["seconds"])
                  for w, o in zip(rows["with"], rows["without"])]
        summary = {v: {"tokens_per_forward": rows[v][0]["tokens"] / rows[v][0]["forwards"],
                       "tokens_per_s_median": statistics.median(x["tokens"] / x["seconds"] for x in rows[v])}
                   for v in variants}
        summary["same_outputs"] = sum(a == b for a, b in zip(outputs["with"], outputs["without"]))
        summary["tasks"] = len(tasks)
        summary["speed_ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        doc["kinds"][kind] = {"rounds": rows, "summary": summary}
        print(f"{kind}: tokens/forward {summary['without']['tokens_per_forward']:.2f} -> "
              f"{summary['with']['tokens_per_forward']:.2f}, tokens/s x{summary['speed_ratio']['median']:.2f} "
              f"[{summary['speed_ratio']['min']:.2f}-{summary['speed_ratio']['max']:.2f}], same output on "
              f"{summary['same_outputs']}/{len(tasks)} tasks", flush=True)
    doc["load_average_end"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
