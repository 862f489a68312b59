"""Distil the built-in model's drafter on a lent GPU within one device call, and measure it against the base.

    python scripts/device_distill.py --out $OUT --deadline 540        # on a lent GPU machine (one call)
    python scripts/device_distill.py --quick --out /tmp/dd            # the same code path on this CPU (smoke run)
    python scripts/device_distill.py --join FETCHED_DIR --to MODEL_DIR

Why: the built-in model's default policy (`speculative`, draft blocks of 4, prompt-lookup drafts) writes exactly
its next-token decoding, so its quality is fixed and its speed is how often the diffusion rows' drafts are kept:
2.3 tokens per forward on the held-out function bodies and next lines (docs/benchmarks.md), against issue 29's
goal of 3. Training the drafter moved the 5.25M model a little at the 1.3M row tokens two CPU cores give
(function bodies 1.28 -> 1.37 tokens per forward); this script spends a GPU's minutes on the 19.9M model instead.

Phases (each a `python -m unmask.cli` process with src/ on PYTHONPATH, as scripts/device_train.py runs them):
1. calibrate: `unmask distill` for a few steps, which also has the teacher (the model itself, block size 1:
   what `speculative` outputs) answer every prompt with the engine, batched, into the trajectory cache;
2. distill: the same recipe for the steps that fit the time left (the calibration's steady tokens/s), on the
   cached answers (the cache is copied, so the teacher does not run again): `--teacher-block-size 1
   --full-block-fraction F` (the draft block fully masked, as inference sees it) with corpus replay;
3. eval: `unmask eval --dtype float32` of the base and the student on the model card's held-out tasks, under the
   default policy and its parts, and the comparison the shipping rule needs (every score at least the base's,
   at least 3 tokens per forward on next lines and function bodies) in summary.json; the chat scores of the model
   card are not run here (`unmask eval` without --chat-limit 0 does, before a student replaces the model);
4. package: the student's weights as bfloat16 shards of at most 15 MiB and meta.tar.gz (device_train.py's).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_train as dt  # noqa: E402  (the shared run / rate / shard helpers)

ROOT = dt.ROOT
EVAL_POLICIES = "speculative_b4_lookup,speculative_b4,threshold_0.9"
SHIP_TOKENS_PER_FORWARD = 3.0   # issue 29's bar for the default policy, on next lines and function bodies
SCORES = ("accuracy", "edit_similarity", "valid")   # higher is better; `repeat` (lower is better) apart


def distill_args(a, out: Path, steps: int) -> list[str]:
    return ["distill", "-m", str(a.model), "--text", a.data, "--chat", a.chat, "--out", str(out),
            "--overwrite", "--prompts", str(a.prompts), "--answer-tokens", str(a.answer_tokens),
            "--teacher-block-size", "1", "--full-block-fraction", str(a.full_block_fraction),
            "--confidence-weight", str(a.confidence_weight), "--mix-text", a.data, "--mix-fraction",
            str(a.mix_fraction), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr),
            *(["--draft-adapter", str(a.draft_adapter)] if a.draft_adapter else []), *dt.schedule(steps)]


def eval_args(model: Path, a, out_json: Path) -> list[str]:
    return ["eval", "-m", str(model), "--policies", EVAL_POLICIES, "--limit", str(a.eval_limit), "--chat-limit",
            "0", "--dtype", "float32", "--corpus", a.data, "--sft-heldout", a.sft_heldout, "--json", str(out_json)]


def compare(base: dict, student: dict) -> dict:
    """Per task and policy: base -> student scores and tokens per forward, and whether the student meets the
    shipping rule on them (every score at least the base's, repeat rate no higher; >= 3 tokens per forward under
    the default policy on next lines and function bodies)."""
    def rows(report: dict) -> dict:
        return {(t["task"], t["policy"]): t for t in report["tasks"]}

    b, s = rows(base), rows(student)
    table, ok = [], True
    for key in sorted(b.keys() & s.keys()):
        old, new = b[key], s[key]
        entry = {"task": key[0], "policy": key[1]}
        for name in (*SCORES, "repeat", "tokens_per_forward"):
            if old.get(name) is not None and new.get(name) is not None:
                entry[name] = [old[name], new[name]]
        worse = [n for n in SCORES if n in entry and entry[n][1] < entry[n][0]]
        if "repeat" in entry and entry["repeat"][1] > entry["repeat"][0]:
            worse.append("repeat")
        entry["worse"] = worse
        ok &= not worse
        table.append(entry)
    default = "speculative_b4_lookup"
    tpf = {e["task"]: e["tokens_per_forward"][1] for e in table if e["policy"] == default}
    fast = all(tpf.get(k, 0) >= SHIP_TOKENS_PER_FORWARD for k in ("next_line", "function"))
    return {"table": table, "scores_at_least_base": ok, "default_tokens_per_forward": tpf,
            "meets_tokens_per_forward": fast, "ships": ok and fast}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "src" / "unmask" / "assets" / "unmask-tiny")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "device-distill")
    ap.add_argument("--runs", type=Path, default=None, help="scratch run directories (default: build/distill-runs)")
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds from start by which the run must be packaged: the distillation gets what the "
                         "calibration (teacher answers included) and the evaluations leave")
    ap.add_argument("--eval-reserve", type=float, default=150.0,
                    help="seconds set aside for the two evaluations (the base's and the student's)")
    ap.add_argument("--steps", type=int, default=None, help="fixed distillation steps (no time planning)")
    ap.add_argument("--prompts", type=int, default=8192)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--full-block-fraction", type=float, default=0.5)
    ap.add_argument("--confidence-weight", type=float, default=0.0)
    ap.add_argument("--draft-adapter", type=int, default=0,
                    help="train only a draft adapter of this rank (the base frozen: speculative output unchanged)")
    ap.add_argument("--mix-fraction", type=float, default=0.25)
    ap.add_argument("--eval-limit", type=int, default=60, help="held-out tasks per kind in each evaluation")
    ap.add_argument("--data", default="data/corpus", help="corpus directory: prompts, replay and held-out tasks")
    ap.add_argument("--chat", default="data/sft/train.jsonl", help="chat / FIM records whose prompts are answered")
    ap.add_argument("--sft-heldout", default="data/sft/heldout.jsonl", help="held-out infill records for the eval")
    ap.add_argument("--quick", action="store_true", help="a few prompts and steps, tiny evaluations (CPU smoke run)")
    dt.add_join_args(ap)
    a = ap.parse_args()
    if a.join:
        dt.join_fetched(a, ap)
        return
    if not (a.model / "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there (a model directory)")
    a.model = a.model.resolve()
    if a.quick:
        a.prompts, a.answer_tokens, a.batch_size, a.seq_len, a.eval_limit = 16, 16, 4, 128, 2
    for need in (f"{a.data}/train.jsonl", f"{a.data}/heldout.jsonl", a.chat, a.sft_heldout):
        if not (ROOT / need).is_file():
            raise SystemExit(f"{need} is missing: run `unmask corpus` (and carry data/ to the device machine)")
    runs = a.runs or ROOT / "build" / "distill-runs"
    logs = runs / "logs"
    a.out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    for phase in ("calibrate", "distill"):
        dt.share_token_cache(runs / phase, runs / "token-cache")
    tokens_per_step = a.batch_size * a.seq_len
    summary: dict = {"model": str(a.model), "recipe": {k: getattr(a, k) for k in (
        "prompts", "answer_tokens", "batch_size", "seq_len", "lr", "full_block_fraction", "confidence_weight",
        "mix_fraction")}}

    def save() -> None:
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    cal_steps = 2 if a.quick else 20
    wall, tps = dt.run("calibrate", distill_args(a, runs / "calibrate", cal_steps), logs)
    rate = dt.steady_rate((logs / "calibrate.log").read_text(), tokens_per_step) or (tps[-1] if tps else None)
    summary["calibrate"] = {"wall_s": wall, "steps": cal_steps, "tokens_per_s": rate}
    # the teacher's answers are cached by the calibration; the distillation reads them instead of regenerating
    cache = runs / "distill" / "trajectories"
    if cache.exists():
        shutil.rmtree(cache)
    shutil.copytree(runs / "calibrate" / "trajectories", cache)
    if a.steps is not None or a.quick:
        steps = a.steps or 3
    else:
        left = a.deadline - (time.monotonic() - dt.START) - a.eval_reserve - dt.PACKAGE_S - dt.STARTUP_S
        steps = dt.steps_for(max(0.0, left), rate or 1000.0, a.batch_size, a.seq_len, 20)
        dt.log(f"distill: {left:.0f} s left for it at ~{rate or 0:,.0f} tokens/s -> {steps} steps")
    wall, tps = dt.run("distill", distill_args(a, runs / "distill", steps), logs)
    summary["distill"] = {"wall_s": wall, "steps": steps, "tokens": steps * tokens_per_step,
                          "tokens_per_s_last": tps[-1] if tps else None}
    report = runs / "distill" / "distill.json"
    if report.is_file():  # the teacher's and the student's compute, for the AR twin comparison
        summary["compute"] = json.loads(report.read_text())
    student = runs / "distill" / "model"
    gen = "generation_config.json"  # the defaults the base ships with (default policy, penalties)
    if (a.model / gen).is_file() and not (student / gen).is_file():
        shutil.copy2(a.model / gen, student / gen)
    save()

    for who, path in (("base", a.model), ("student", student)):
        wall, _ = dt.run(f"eval-{who}", eval_args(path, a, runs / f"eval-{who}.json"), logs)
        summary[f"eval_{who}_s"] = wall
        shutil.copy2(runs / f"eval-{who}.json", a.out / f"eval-{who}.json")
    summary["comparison"] = compare(json.loads((runs / "eval-base.json").read_text()),
                                    json.loads((runs / "eval-student.json").read_text()))
    save()

    dt.export_bf16_shards(student, runs / "export")
    summary["shards"] = dt.package(runs / "export", logs, a.out)
    summary["total_s"] = time.monotonic() - dt.START
    save()
    c = summary["comparison"]
    dt.log(f"done in {summary['total_s']:.0f} s: default tokens/forward {c['default_tokens_per_forward']}, scores "
           f"at least the base's: {c['scores_at_least_base']}, ships: {c['ships']}")


if __name__ == "__main__":
    main()
