"""The benchmark suite: regenerates docs/benchmarks.md, docs/benchmarks.json and docs/bench/*.png.

    python bench/suite.py            # full (make bench): under 30 minutes on 2 idle cores
    python bench/suite.py --quick    # smoke run (make bench-quick): a few minutes, no network

Sections (--sections, comma-separated; default all):
  policies  speed vs quality per decoding policy on the held-out tasks, with the AR twin beside them
  cost      time per generated token and peak memory vs prompt length (1K..128K) and generation length
  batch     offline API throughput at batch 1, 4, 16, 64
Opt-in (named in --sections only; `make bench` runs it after the suite):
  longprefill  real chunked prefills of 32K, 64K and 128K tokens, one round (6.3 minutes on 2 cores here)
A run of some sections merges them into the existing JSON (when it was written in the same mode) and
regenerates the whole document. --report-only re-renders the document from the JSON.

Model: --model DIR (default: bench/models/unmask-tiny-5m, the 5.25M model the committed AR twin is
compute-matched to and the built-in model until 2026-12-04; else the built-in model). Twin: --twin DIR, a Hugging Face causal LM written by
scripts/train_ar_twin.py (default: runs/ar-twin/model, in --quick mode build/ar-twin-quick/model);
--twin-gguf FILE adds llama.cpp when llama-cpp-python is installed. Data: `unmask corpus` output.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TWIN_DIR = "bench/models/ar-twin"  # committed by `make twin`
TWIN_REFERENCE = "bench/models/unmask-tiny-5m"  # the diffusion model that twin is compute-matched to (`make model-5m`)
sys.path.insert(0, str(HERE))
if str(ROOT / "src") not in sys.path:
    sys.path.append(str(ROOT / "src"))

from benchlib import common  # noqa: E402

SECTIONS = ("policies", "cost", "batch")
OPT_IN = ("longprefill",)


def core_wall_s(done: dict, ran: list[str], wall: float | None) -> float:
    """Wall time of the suite's core sections, outside its budget the opt-in ones: this run's own wall time
    less the opt-in sections it ran (`wall`, when it ran every core section), else the sum of the core
    sections' recorded times."""
    if wall is None:
        return sum(s.get("wall_s", 0) for k, s in done.items() if k not in OPT_IN)
    return wall - sum(done[k].get("wall_s", 0) for k in OPT_IN if k in ran and k in done)
K = 1024
CONFIGS = {
    "full": {
        "policies": {"n_next_line": 200, "n_infill": 200, "rounds": 3},
        "cost": {"prefill_lengths": [1 * K, 2 * K, 4 * K, 8 * K, 16 * K],
                 "context_lengths": [1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K],
                 "gen_lengths": [64, 128, 256, 512, 1024, 2048], "decode_tokens": 32, "rounds": 3},
        "batch": {"batches": [1, 4, 16, 64], "max_tokens": 64, "rounds": 3},
        "longprefill": {"lengths": [32 * K, 64 * K, 128 * K], "decode_tokens": 32, "rounds": 1},
    },
    "quick": {
        "policies": {"n_next_line": 6, "n_infill": 4, "rounds": 2},
        "cost": {"prefill_lengths": [1 * K, 2 * K], "context_lengths": [1 * K, 4 * K, 16 * K],
                 "gen_lengths": [64, 128, 256], "decode_tokens": 12, "rounds": 2},
        "batch": {"batches": [1, 4, 16], "max_tokens": 16, "rounds": 2},
        "longprefill": {"lengths": [4 * K], "decode_tokens": 8, "rounds": 1},
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rel(p: Path | None) -> str | None:
    if p is None:
        return None
    p = Path(p).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def command(args, sections: list[str] | None) -> str:
    parts = [common.python_cmd(), "bench/suite.py"]
    if args.quick:
        parts.append("--quick")
    if args.model:
        parts += ["--model", rel(args.model)]
    if args.twin:
        parts += ["--twin", rel(args.twin)]
    if args.twin_gguf:
        parts += ["--twin-gguf", rel(args.twin_gguf)]
    parts += ["--threads", str(args.threads)]
    if args.out_dir.resolve() != (ROOT / "docs").resolve():
        parts += ["--out-dir", rel(args.out_dir)]
    if sections:
        parts += ["--sections", ",".join(sections)]
    return " ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--twin", type=Path, default=None)
    ap.add_argument("--twin-gguf", type=Path, default=None)
    ap.add_argument("--no-twin", action="store_true")
    ap.add_argument("--distilled", type=Path, default=None,
                    help="a distilled model (unmask distill) decoded beside --model, every policy, interleaved")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores available)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="weights of unmask and of the AR twin alike (default float32: the committed figures')")
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/corpus")
    ap.add_argument("--sft-heldout", type=Path, default=ROOT / "data/sft/heldout.jsonl")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs", help="where benchmarks.{md,json} and bench/ go")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    mode = "quick" if args.quick else "full"
    out_json = args.out_dir / "benchmarks.json"
    doc = args.out_dir / "benchmarks.md"
    img_dir = args.out_dir / "bench"

    from benchlib import report

    if args.report_only:
        report.render(json.loads(out_json.read_text()), doc, img_dir)
        log(f"wrote {rel(doc)}")
        return

    import torch

    args.threads = args.threads or common.machine()["cores"]
    torch.set_num_threads(args.threads)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS + OPT_IN]
    if bad:
        sys.exit(f"unknown section {bad[0]!r}; choose from {', '.join(SECTIONS + OPT_IN)}")
    cfg = CONFIGS[mode]
    t_suite = time.perf_counter()

    from unmask.defaults import default_model_path
    from unmask.engine.llm import LLM

    if args.model is None:  # the model the AR twin is compute-matched to, else the built-in one
        args.model = next((p for p in (ROOT / TWIN_REFERENCE, default_model_path()) if p.is_dir()), None)
        if args.model is None:
            sys.exit(f"the built-in model is not installed at {default_model_path()}; pass --model DIR")
    if not (args.corpus / "heldout.jsonl").is_file():
        sys.exit(f"{args.corpus / 'heldout.jsonl'} not found: run `unmask corpus` first")
    if args.twin is None and not args.no_twin:
        cands = (["build/ar-twin-quick/model"] if args.quick else [TWIN_DIR, "runs/ar-twin/model"])
        args.twin = next((ROOT / c for c in cands if (ROOT / c).is_dir()), None)

    data = {"meta": {}, "sections": {}}
    if out_json.is_file():
        old = json.loads(out_json.read_text())
        if old.get("meta", {}).get("mode") == mode and not set(SECTIONS) <= set(sections):
            data = old  # merge a partial run into the same mode's results
        elif old.get("meta", {}).get("mode") == mode and "longprefill" in old["sections"]:
            data["sections"]["longprefill"] = old["sections"]["longprefill"]  # kept across full runs (opt-in)
    machine = common.machine()
    llm = LLM(args.model, dtype=args.dtype)
    spec = llm.spec
    model_info = {"model": rel(spec.path), "family": spec.family.name, "block_size": spec.block_size,
                  "threads": args.threads, "dtype": args.dtype}
    log(f"{mode} run of {', '.join(sections)}: model {rel(spec.path)} ({spec.family.name}), "
        f"{args.threads} thread(s), load average {machine['load_average_start']}")

    if "policies" in sections:
        from benchlib import policies, twin

        c = cfg["policies"]
        t0 = time.perf_counter()
        tasks, task_info = policies.load_tasks(llm, args.corpus, args.sft_heldout, c["n_next_line"], c["n_infill"])
        bidir = spec.family.attention == "bidirectional"
        variants = policies.unmask_variants(spec.block_size, bidir, llm.engine.traits.commit_filter is not None,
                                            speculative=policies.speculative_model(llm),
                                            ngrams=llm.engine.traits.ngram_drafts is not None)
        distilled = None
        if args.distilled is not None:
            other = LLM(args.distilled, dtype=args.dtype)
            probe = "def f(x):\n    return x  # <|fim_prefix|>"
            if other.encode(probe) != llm.encode(probe) or other.spec.block_size != spec.block_size:
                sys.exit(f"distilled model {args.distilled} does not share the model's tokenizer and block size")
            variants += policies.model_variants(other, spec.block_size, "distilled")
            distilled = rel(args.distilled)
        tw = {"path": None}
        if args.twin is not None:
            hf = twin.HFTwin(args.twin, dtype=args.dtype)
            probe = "def f(x):\n    return x  # <|fim_prefix|>"
            if hf.tok.encode(probe, add_special_tokens=False) != llm.encode(probe):
                sys.exit(f"twin {args.twin} does not share the model's tokenizer")
            info = twin.twin_info(args.twin)
            tw = {"path": rel(args.twin), "architecture": info.get("architecture"), "params": hf.params,
                  "quick": bool(info.get("quick")), "budget": info.get("budget"), "info": info}
            variants.append(policies.Variant(hf.name, "AR twin, transformers generate (KV cache)", decoder=hf,
                                             cache="KV (DynamicCache)", group="twin"))
            loop = twin.HFTwinLoop.sharing(hf)
            variants.append(policies.Variant(loop.name, "AR twin, plain greedy loop, unmask's CPU linears",
                                             decoder=loop, cache="KV (DynamicCache)", group="twin"))
            lc, lc_info = twin.llama_cpp_decoder(args.twin, args.twin_gguf, hf, args.threads,
                                                 llm.encode(tasks[0].prompt))
            if lc is not None:
                variants.append(policies.Variant(lc.name, "AR twin, llama.cpp (GGUF)", decoder=lc,
                                                 cache="KV (llama.cpp)", group="twin"))
                lc_info["llama_cpp_gguf"] = rel(Path(lc_info["llama_cpp_gguf"]))
            tw.update(lc_info)
        else:
            tw["llama_cpp_reason"] = "no twin model"
        log(f"policies: {len(tasks)} tasks x {len(variants)} variants x {c['rounds']} rounds")
        sec = policies.run_section(llm, variants, tasks, c["rounds"], log)
        sec.update(model_info, tasks=task_info, bidirectional=bidir, twin=tw, config=c, distilled=distilled,
                   command=command(args, ["policies"]), wall_s=time.perf_counter() - t0,
                   load_average_end=common.load_average())
        data["sections"]["policies"] = sec

    if "cost" in sections:
        from benchlib import cost

        t0 = time.perf_counter()
        log("cost: prefill, context and generation curves")
        sec = cost.run_section(llm.model, spec, llm.tokenizer, args.corpus / "heldout.jsonl", cfg["cost"], log)
        sec.update(model_info, command=command(args, ["cost"]), wall_s=time.perf_counter() - t0,
                   load_average_end=common.load_average())
        data["sections"]["cost"] = sec

    if "longprefill" in sections:
        from benchlib import cost

        t0 = time.perf_counter()
        log(f"longprefill: real chunked prefills of {cfg['longprefill']['lengths']} tokens")
        sec = cost.run_long_prefill(llm.model, spec, llm.tokenizer, args.corpus / "heldout.jsonl",
                                    cfg["longprefill"], log)
        sec.update(model_info, command=command(args, ["longprefill"]), wall_s=time.perf_counter() - t0,
                   load_average_end=common.load_average(), git=machine.get("git"), date=machine.get("date"))
        data["sections"]["longprefill"] = sec

    if "batch" in sections:
        from benchlib import batch
        from benchlib.policies import load_tasks

        c = cfg["batch"]
        t0 = time.perf_counter()
        tasks, _ = load_tasks(llm, args.corpus, args.sft_heldout, max(c["batches"]), 0)
        prompts = [llm.encode(t.prompt) for t in tasks if t.kind == "next_line"]
        log(f"batch: {max(c['batches'])} requests at batch {c['batches']}")
        sec = batch.run_section(llm, prompts, c["batches"], c["max_tokens"], c["rounds"], log)
        sec.update(model_info, command=command(args, ["batch"]), wall_s=time.perf_counter() - t0,
                   load_average_end=common.load_average())
        data["sections"]["batch"] = sec

    wall = time.perf_counter() - t_suite
    machine["load_average_end"] = common.load_average()
    complete = set(SECTIONS) <= set(sections)
    if not (set(sections) <= set(OPT_IN) and data["meta"]):  # an opt-in-only run leaves the suite's meta as it was
        data["meta"] = {
            "mode": mode, "command": command(args, None), "make": "make bench-quick" if args.quick else "make bench",
            "machine": machine, "config": cfg, "json_name": out_json.name,
            "suite_wall_s": core_wall_s(data["sections"], sections, wall if complete else None),
            "suite_wall_complete": complete,
        }
    common.write_json(out_json, data, default=str)
    report.render(data, doc, img_dir)
    log(f"done in {wall:.0f} s: {rel(out_json)}, {rel(doc)}, {rel(img_dir)}/*.png")


if __name__ == "__main__":
    main()
