"""Self-speculative decoding (policy `speculative`) against the default policy, the model's own next-token decoding
and the AR twin, batch 1, interleaved, on the model card's held-out next-line and infill tasks.

Variants per unmask model: `next_token_greedy` (block 1, one token per forward: the output `speculative` must
reproduce), `threshold_0.9` (the default), `speculative` (one draft block a step), `speculative_all` (a draft
block per outcome), `speculative_b4` (draft blocks of 4: a narrower forward, for CPUs) and
`speculative_b4_lookup` (the built-in model's default: also prompt-lookup drafts, and n-gram table drafts where the
model ships a table; `speculative_b4_lookup_no_ngrams` without the table), or the subset --variants names;
with --distilled the same ones on a second model of the same tokenizer (e.g. one trained by `unmask distill --teacher-block-size 1
--full-block-fraction F`); the AR twin through transformers `generate`, and each variant's tokens/s over the twin's ("x twin");
with --twin-lookup N also the twin through `generate` with transformers' prompt lookup decoding (N-token drafts).
With --compiled every variant runs a second time on an engine with the compiled CPU step
(engine/compiled_step.py), each task decoded once untimed first so every step shape is compiled before the rounds.
Rounds rotate the order per task (A B A B); speeds are medians over rounds with min-max, and ratios are taken
within each round (benchlib.policies.run_section, the suite's policy section).

    .venv/bin/python bench/speculative.py --threads 2 --json docs/bench/speculative-5m.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = [
    ("next_token_greedy", "next-token rows, one token per forward (block 1)",
     dict(policy="topk", tokens_per_step=1, block_size=1)),
    ("threshold_0.9", "threshold 0.9 (default)", dict(policy="threshold", threshold=0.9)),
    ("speculative", "self-speculative, one draft block", dict(policy="speculative")),
    ("speculative_all", "self-speculative, a draft block per outcome", dict(policy="speculative",
                                                                            draft_all_outcomes=True)),
    ("speculative_b4", "self-speculative, draft blocks of 4", dict(policy="speculative", block_size=4)),
    ("speculative_b4_lookup", "self-speculative, draft blocks of 4 and up to 8 prompt-lookup drafts",
     dict(policy="speculative", block_size=4, draft_lookup=8)),
    ("speculative_b4_lookup_no_ngrams", "the same without the model's n-gram draft table",
     dict(policy="speculative", block_size=4, draft_lookup=8, draft_ngrams=False)),
    ("speculative_b4_lookup_all", "draft blocks of 4 and lookup drafts, a draft block per outcome",
     dict(policy="speculative", block_size=4, draft_lookup=8, draft_all_outcomes=True)),
    ("speculative_b8_lookup", "draft blocks of 8 and lookup drafts",
     dict(policy="speculative", block_size=8, draft_lookup=8)),
    ("speculative_b8_lookup_all", "draft blocks of 8 and lookup drafts, a draft block per outcome",
     dict(policy="speculative", block_size=8, draft_lookup=8, draft_all_outcomes=True)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "bench/models/unmask-tiny-5m")
    ap.add_argument("--distilled", type=Path, default=None)
    ap.add_argument("--twin", type=Path, default=ROOT / "bench/models/ar-twin")
    ap.add_argument("--no-twin", action="store_true")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also the twin through llama.cpp (llama-cpp-python, `make llama-cpp`), from --twin-gguf or "
                         "a float32 GGUF written beside the twin on first use")
    ap.add_argument("--twin-gguf", type=Path, default=None)
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/corpus")
    ap.add_argument("--sft-heldout", type=Path, default=ROOT / "data/sft/heldout.jsonl")
    ap.add_argument("--next-line", type=int, default=133)
    ap.add_argument("--infill", type=int, default=59)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both sides' weights (bfloat16: what `unmask serve` picks on CPUs with AVX512-BF16 / AMX)")
    ap.add_argument("--variants", default=",".join(n for n, _, _ in VARIANTS),
                    help="comma-separated subset of the unmask variants, run for each model (the first is the "
                         "baseline of the 'x first' column)")
    ap.add_argument("--compiled", action="store_true",
                    help="also each variant with the compiled CPU step (engine/compiled_step.py; bfloat16), every "
                         "task decoded once untimed first so each step shape is compiled before the rounds")
    ap.add_argument("--twin-lookup", type=int, default=0,
                    help="also the twin through generate with transformers' prompt lookup decoding, this many "
                         "tokens a draft (prompt_lookup_num_tokens; 0: not run)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    known = {n: (n, lbl, knobs) for n, lbl, knobs in VARIANTS}
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not chosen or any(v not in known for v in chosen):
        sys.exit(f"--variants: choose from {', '.join(known)}")
    selected = [known[v] for v in chosen]
    sys.path.insert(0, str(ROOT / "bench"))
    from benchlib import policies, twin
    from benchlib.common import ratio_summary, write_json

    from unmask.engine.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device="cpu")
    if not policies.speculative_model(llm):
        sys.exit(f"{args.model} has no causal context: policy speculative does not run on it")
    variants = [policies.Variant(n, lbl, knobs) for n, lbl, knobs in selected]
    if args.distilled is not None:
        other = LLM(args.distilled, dtype=args.dtype, device="cpu")
        from unmask.engine.engine import Engine

        other.engine = Engine(other.model, other.spec, other.tokenizer, max_num_seqs=1, prefix_cache_bytes=0)
        variants += [policies.Variant(f"distilled:{n}", f"distilled: {lbl}", knobs, group="distilled", llm=other)
                     for n, lbl, knobs in selected]
    if args.compiled:
        from unmask.engine.engine import Engine

        models = [("compiled", args.model)] + ([("distilled-compiled", args.distilled)] if args.distilled else [])
        for group, path in models:
            c = LLM(path, dtype=args.dtype, device="cpu")
            c.engine = Engine(c.model, c.spec, c.tokenizer, max_num_seqs=1, prefix_cache_bytes=0, compile_step=True)
            if c.engine.runner.compiled is None:
                sys.exit(f"--compiled: the compiled step does not take {path} in {args.dtype} (see the log)")
            variants += [policies.Variant(f"{group}:{n}", f"{group}: {lbl}", knobs, group=group, llm=c,
                                          warmup_tasks=10 ** 9) for n, lbl, knobs in selected]
    twin_name = None
    if not args.no_twin:
        hf = twin.HFTwin(args.twin, dtype=args.dtype)
        twin_name = hf.name
        variants.append(policies.Variant(hf.name, "AR twin, transformers generate (KV cache)", decoder=hf,
                                         cache="KV (DynamicCache)", group="twin"))
        if args.twin_lookup:
            hl = twin.HFTwinLookup.sharing(hf, args.twin_lookup)
            variants.append(policies.Variant(hl.name, f"AR twin, generate + prompt lookup ({args.twin_lookup})",
                                             decoder=hl, cache="KV (DynamicCache)", group="twin"))
    tasks, info = policies.load_tasks(llm, args.corpus, args.sft_heldout, args.next_line, args.infill)
    if args.llama_cpp and not args.no_twin:
        lc, info["llama_cpp"] = twin.llama_cpp_decoder(args.twin, args.twin_gguf, hf, torch.get_num_threads(),
                                                       llm.encode(tasks[0].prompt))
        if lc is None:
            sys.exit(f"--llama-cpp: {info['llama_cpp']['llama_cpp_reason']}")
        variants.append(policies.Variant(lc.name, "AR twin, llama.cpp (GGUF)", decoder=lc, cache="KV (llama.cpp)",
                                         group="twin"))
    t0 = time.perf_counter()
    results = policies.run_section(llm, variants, tasks, args.rounds, lambda m: print(m, flush=True))
    if twin_name:  # each variant's tokens/s over the twin's, round by round (interleaved), median and range
        for r in results["variants"].values():
            r["speed_vs_twin"] = ratio_summary(r["tokens_per_s_rounds"], results["variants"][twin_name]["tokens_per_s_rounds"])
    print(f"{'variant':32} {'acc':>6} {'tok/fwd':>8} {'tok/s':>8} {'ms/req':>7} {'x first':>8} {'x default':>10} "
          f"{'x twin':>7}")
    for n, r in results["variants"].items():
        tpf, tps, ms = r["tokens_per_forward"]["median"], r["tokens_per_s"]["median"], r["latency_ms"]["median"]
        vs_first = r["speed_vs_baseline"]["median"]
        vs_def = r.get("speed_vs_default", {}).get("median")
        vs_twin = r.get("speed_vs_twin", {}).get("median")
        print(f"{n:32} {r['accuracy']:6.1%} {tpf:8.2f} {tps:8.1f} {ms:7.1f} {vs_first:8.2f} "
              f"{'' if vs_def is None else f'{vs_def:.2f}':>10} {'' if vs_twin is None else f'{vs_twin:.2f}':>7}")
    compiled = {v.name: {"compiles": v.llm.engine.runner.compiled.compiles,
                         "compile_s": v.llm.engine.runner.compiled.compile_s,
                         "compiled_steps": v.llm.engine.runner.compiled.runs}
                for v in variants if v.group.endswith("compiled")}
    for n, c in compiled.items():
        print(f"{n}: {c['compiles']} shapes compiled in {c['compile_s']:.0f} s (engine total, shared by its variants)")
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "compiled_step": compiled, "model": str(args.model), "distilled": str(args.distilled),
                               "threads": torch.get_num_threads(), "dtype": args.dtype, "rounds": args.rounds,
                               "tasks": info, "seconds": time.perf_counter() - t0, "results": results}, default=str)


if __name__ == "__main__":
    main()
