"""Train the built-in model for long context on a lent GPU within one device call, then score the needle.

    python scripts/device_long_context.py --out $OUT --deadline 540     # on a lent GPU (docs/training.md,
                                                                        # "Long context": the call and its carry)
    python scripts/device_long_context.py --quick --out /tmp/dlc        # the same code path on this CPU (smoke run)
    python scripts/device_long_context.py --needle-only MODEL --out DIR # the needle alone, on any model directory
    python scripts/device_long_context.py --join FETCHED_DIR --to MODEL_DIR

Issue 34: needle accuracy >= 90% at every depth to 16K and >= 50% at 128K for the built-in 19.9M model, which was
trained on rows of 512 tokens. Phases, each a `python -m unmask.cli` process with src/ on PYTHONPATH as
scripts/device_train.py runs them:
1. stages of growing length (default 2K x 16 rows, 8K x 4, 32K x 1 a step): `unmask train --init-from PREVIOUS
   --long-documents --passkey-fraction F --rope-scaling yarn:FACTOR`. The first stage starts with a short run that
   measures tokens/s and is then resumed from its checkpoint (no step is thrown away); each stage gets its share
   of the time left at a rate predicted from the last measured one (`predict_rate`: FLOPs).
   A stage that overruns its time is stopped and exported from its last checkpoint (one every ~1/8 of its
   steps); one that fails (out of memory, say) is tried once at half the length and twice the rows, then
   dropped, and the previous stage's model goes on.
2. export: the final model's weights as bfloat16 shards + meta.tar.gz (device_train.py's), before the evaluation,
   so a call cut short still brings the model back.
3. needle: `unmask.evaluation_needle.report` (what `unmask eval --needle` and bench/needle.py run) one length at a
   time, shorter first, fewer trials at the long lengths, cut to what the deadline leaves; needle.json and
   needle.png (bench/needle.py's heat-map) are rewritten after each length.
4. held-out losses at 512 tokens (`unmask eval --limit 0 --chat-limit 0`) of the starting and the final model,
   on the CPU (the losses feed the model CPU tensors), into summary.json: what the long training cost at short
   context.

RoPE scaling: `--rope-scaling yarn:F` sets the context to F x `original_max_position_embeddings`, which
`long_context.scale_rope` takes from the init model's existing rope_scaling or else its max_position_embeddings
(2048 for the built-in model, though it was trained on 512-token rows), and a later stage's factor replaces the
earlier one relative to the same original. So each stage's factor here is --context-ratio x its length / that
original (4 x 32K / 2048 = 64 for the last stage: the 128K context of the longest needle), and a stage whose
context the model already has gets no scaling.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_train as dt  # noqa: E402  (the shared run / shard / package helpers)

ROOT = dt.ROOT
if str(ROOT / "src") not in sys.path:
    sys.path.append(str(ROOT / "src"))  # the device machine has no install (an installed unmask comes first)
BUILT_IN = ROOT / "src" / "unmask" / "assets" / "unmask-tiny"
LOSS_RESERVE_S = 40.0   # the two held-out loss evaluations at the end (CPU, 512-token rows)
MIN_STEPS = 5
# the boolean [2L, 2L] mask (4.3 GB at 32K) was built on the GPU each step since 15c37b6 (it used to cross from the
# CPU's cache); rows past two_stream.CHUNK have no such mask since 2026-12-07, so no copy is charged
MASK_COPY_BYTES_PER_S = float("inf")


def parse_stages(spec: str) -> list[tuple[int, int]]:
    """"2048:16,8192:4" -> [(2048, 16), (8192, 4)]: (row length, rows a step), lengths strictly growing."""
    try:
        stages = [(int(a), int(b)) for a, b in (s.split(":") for s in spec.split(","))]
    except ValueError:
        raise ValueError(f"--stages takes LENGTH:ROWS,... (e.g. 2048:16,8192:4), got {spec!r}") from None
    if not stages or any(n < 16 or b < 1 for n, b in stages) or any(x[0] >= y[0] for x, y in zip(stages, stages[1:])):
        raise ValueError(f"--stages: lengths of at least 16 tokens, growing, and at least 1 row a step; got {spec!r}")
    return stages


def parse_trials(lengths: list[int], spec: str) -> list[int]:
    """--needle-trials: one count for every length, or one per length."""
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--needle-trials takes whole numbers, got {spec!r}") from None
    if len(counts) == 1:
        counts = counts * len(lengths)
    if len(counts) != len(lengths) or min(counts) < 1:
        raise ValueError(f"--needle-trials: one count >= 1, or one per length ({len(lengths)}), got {spec!r}")
    return counts


def original_context(config: dict) -> int:
    """The context `--rope-scaling` scales (long_context.scale_rope's rule, read from the init model's config)."""
    prior = config.get("rope_scaling") or {}
    return int(prior.get("original_max_position_embeddings") or config.get("max_position_embeddings") or 0)


def stage_factors(lengths: list[int], original: int, ratio: float, longest_needle: int) -> list[float | None]:
    """Each stage's YaRN factor: a context of `ratio` x its row length (the last stage's at least the longest
    needle's), relative to `original`; None where the model's context already covers it (no scaling)."""
    factors: list[float | None] = []
    for i, n in enumerate(lengths):
        want = ratio * n if i < len(lengths) - 1 else max(ratio * n, longest_needle)
        f = want / original
        factors.append(round(f, 4) if f > 1.0 else None)
    return factors


def cost_per_token(config: dict, length: int) -> float:
    """Training FLOPs per corpus token at a row length (the planning model, not a measurement). The built-in
    model trains block diffusion with a causal context: every row runs as [x_t ; x_0], 2L positions. Rows of up
    to two_stream.CHUNK tokens go under one boolean [2L, 2L] mask, whose whole square SDPA computes: 2 queries x
    2L keys a corpus token. Longer rows are split (models/two_stream.py): a clean query reads L/2 keys on average
    (causal, the kernel skips the rest), a noisy one the clean keys before its chunk's end and its chunk, L/2 +
    1.5 CHUNK on average. Linear part: 6 FLOPs per weight and position (forward and backward) over both streams,
    the LM head over one; attention: QK^T and AV at 2 FLOPs per multiply-add, backward ~2.5x forward (the kernel
    recomputes)."""
    from unmask.models.two_stream import CHUNK

    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_layer = 2 * h * heads * d + 2 * h * kv * d + 3 * h * config["intermediate_size"]
    linear = 2 * 6 * layers * per_layer + 6 * h * config["vocab_size"]
    keys = 2 * (2 * length) if length <= CHUNK else length + 1.5 * CHUNK
    attention = 3.5 * 2 * 2 * keys * heads * d * layers
    return float(linear + attention)


def predict_rate(config: dict, length0: int, rows0: int, rate0: float, length: int, rows: int, cuda: bool) -> float:
    """Corpus tokens/s at (length, rows) from a rate measured at (length0, rows0): the measured step's time less
    its mask copy gives the FLOP/s, which the new step's FLOPs (`cost_per_token`) and mask copy are timed at."""
    def copy_s(n: int) -> float:
        return (2 * n) ** 2 / MASK_COPY_BYTES_PER_S if cuda else 0.0

    step0 = rows0 * length0 / rate0
    flops_per_s = rows0 * length0 * cost_per_token(config, length0) / max(step0 - copy_s(length0), 0.2 * step0)
    return rows * length / (rows * length * cost_per_token(config, length) / flops_per_s + copy_s(length))


def steady_rate(log_text: str, tokens_per_step: int) -> float | None:
    """Tokens/s between a log's last two progress lines. The trainer prints the average since its own start (the
    step it resumed at, for a resumed run), which counts the first steps' warm-up (device_train.steady_rate)."""
    m = re.search(r"resumed at step (\d+)", log_text)
    first = int(m.group(1)) if m else 0
    points = [(int(a), float(b.replace(",", ""))) for a, b in re.findall(r"step (\d+)/\d+ .*?([\d,]+) tok/s", log_text)]
    points = [(s, r) for s, r in points if s > first and r > 0]
    if len(points) < 2 or points[-1][0] <= points[-2][0]:
        return None
    (s1, r1), (s2, r2) = points[-2:]
    t1, t2 = (s1 - first) * tokens_per_step / r1, (s2 - first) * tokens_per_step / r2
    return (s2 - s1) * tokens_per_step / (t2 - t1) if t2 > t1 else None


def plan_stage(seconds_left: float, share: float, shares_left: float, overhead: float, stages_left: int,
               rate: float, rows: int, length: int) -> tuple[float, int]:
    """This stage's seconds (its share of what is left once each remaining stage's start-up is set aside) and the
    steps they hold at `rate` corpus tokens/s."""
    usable = max(0.0, seconds_left - overhead * stages_left)
    seconds = usable * share / shares_left
    return seconds, max(MIN_STEPS, int(seconds * rate / (rows * length)))


def runner_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                              if p]), HF_HUB_OFFLINE="1")


def run_cli(name: str, args: list[str], logs: Path, timeout: float | None = None, env: dict | None = None) -> dict:
    """One `unmask` command with its output in logs/NAME.log: {"ok", "wall_s", "error"}; a failure or timeout is
    reported, not raised, so the stages before it still count."""
    t0 = time.monotonic()
    dt.log(f"{name}: unmask {' '.join(args)}" + (f" (timeout {timeout:.0f} s)" if timeout else ""))
    with open(logs / f"{name}.log", "w") as f:
        try:
            p = subprocess.run([sys.executable, "-m", "unmask.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                               env=env or runner_env(), cwd=ROOT, timeout=timeout)
            error = f"exit {p.returncode}" if p.returncode else None
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
    text = (logs / f"{name}.log").read_text()
    wall = time.monotonic() - t0
    # the last two lines with text, past the box typer draws around an error
    lines = [ln.strip(" │╭╮╰╯─") for ln in text.splitlines() if re.search(r"[A-Za-z0-9]", ln)]
    tail = " ".join(lines[-2:])[-240:]
    dt.log(f"{name}: {'ok' if error is None else error} in {wall:.0f} s; {tail}")
    return {"ok": error is None, "wall_s": round(wall, 1), "error": error and f"{error}: {tail}"}


def train_args(a, init: Path, out: Path, length: int, rows: int, factor: float | None, steps: int, warmup: int,
               resume: bool, save_every: int = 0) -> list[str]:
    args = ["train", "--init-from", str(init), "--out", str(out), "--data", a.data, "--seq-len", str(length),
            "--batch-size", str(rows), "--steps", str(steps), "--warmup", str(warmup), "--lr", str(a.lr),
            "--long-documents", "--passkey-fraction", str(a.passkey_fraction), "--eval-every",
            str(max(1, steps // 2)), "--save-every", str(save_every), "--resume" if resume else "--overwrite"]
    if factor is not None:
        args += ["--rope-scaling", f"yarn:{factor:g}"]
    if a.cuda:
        args.append("--bf16")
    return args


def checkpoint_step(out: Path) -> int | None:
    """The step of the run's last checkpoint (written atomically, so a kill leaves the one before)."""
    import torch

    path = out / "checkpoint.pt"
    return int(torch.load(path, map_location="cpu", weights_only=False)["step"]) if path.is_file() else None


def fresh_run_dir(out: Path, runs: Path) -> None:
    """An empty stage directory (no checkpoint of an earlier invocation to resume or export by mistake) sharing the
    corpus's token cache."""
    if out.exists():
        shutil.rmtree(out)
    dt.share_token_cache(out, runs / "token-cache")


def run_stages(a, runs: Path, logs: Path, summary: dict, save) -> Path:
    """The stages in turn; returns the last good model directory (the init model if none finished)."""
    config = json.loads((a.model / "config.json").read_text())
    original = original_context(config)
    stages = parse_stages(a.stages)
    factors = stage_factors([n for n, _ in stages], original, a.context_ratio, max(a.lengths))
    shares = [float(x) for x in a.split.split(",")]
    if len(shares) != len(stages):
        raise SystemExit(f"--split has {len(shares)} shares for {len(stages)} stages")
    summary["plan"] = {"original_context": original, "context_ratio": a.context_ratio,
                       "stages": [{"length": n, "rows": b, "yarn_factor": f, "context": int(original * f) if f else
                                   original} for (n, b), f in zip(stages, factors)]}
    train_until = a.deadline - a.eval_reserve - dt.PACKAGE_S  # seconds from the start
    init, measured, overhead = a.model, None, a.startup
    summary["stages"] = []
    i, retried = 0, set()
    while i < len(stages):
        (length, rows), factor = stages[i], factors[i]
        name, out = f"stage{i + 1}-{length}", runs / f"stage{i + 1}"
        fresh_run_dir(out, runs)
        per_step = rows * length
        record = {"length": length, "rows": rows, "yarn_factor": factor}
        if measured is None:  # the first stage: a short run measures the rate, then resumes from its checkpoint
            cal = 2 if a.quick else a.calibrate_steps
            res = run_cli(f"{name}-calibrate", train_args(a, init, out, length, rows, factor, cal, cal, False), logs,
                          timeout=max(60.0, train_until - (time.monotonic() - dt.START)))
            text = (logs / f"{name}-calibrate.log").read_text()
            rate = steady_rate(text, per_step) or _last_rate(text)
            record["calibration"] = {**res, "steps": cal, "tokens_per_s": rate}
            if not res["ok"] or not rate:
                summary["stages"].append(record)
                save()
                dt.log(f"{name}: the calibration failed; training stops at the init model")
                return init
            overhead = max(a.startup, res["wall_s"] - cal * per_step / (_last_rate(text) or rate))
            predicted, resume, floor = rate, True, cal
        else:
            predicted = predict_rate(config, *measured, length, rows, a.cuda) * a.margin
            resume, floor = False, 0
        seconds, steps = plan_stage(train_until - (time.monotonic() - dt.START), shares[i], sum(shares[i:]),
                                    overhead, len(stages) - i, predicted, rows, length)
        steps = min(steps + floor, 3) if a.quick else steps + floor
        warmup = floor if resume else max(1, min(20, steps // 10))
        scaling = f"yarn:{factor:g}" if factor else "no scaling: the context covers it"
        dt.log(f"{name}: {seconds:.0f} s at ~{predicted:,.0f} tokens/s -> {steps} steps ({scaling})")
        # past its time (a rate predicted too high) the stage is stopped and exported from its last checkpoint
        # (one every ~1/8 of its steps), so an overrun costs the steps since then, not the stage
        left = train_until - (time.monotonic() - dt.START)
        limit = a.stage_seconds or max(60.0, min(left + a.eval_reserve / 4, 1.2 * seconds + overhead))
        args = train_args(a, init, out, length, rows, factor, steps, warmup, resume, max(1, (steps - floor) // 8))
        res = run_cli(name, args, logs, limit)
        text = (logs / f"{name}.log").read_text()
        rate = steady_rate(text, per_step) or _last_rate(text)
        done = steps
        if res["error"] and res["error"].startswith("timed out") and (done := checkpoint_step(out) or 0) > floor:
            cut = run_cli(f"{name}-export", train_args(a, init, out, length, rows, factor, done, warmup, True), logs,
                          timeout=180.0)
            record["cut"] = {"at_step": done, "export": cut}
            res = {**res, "ok": cut["ok"]}
        record.update({**res, "steps": done, "planned_steps": steps, "planned_s": round(seconds, 1),
                       "predicted_tokens_per_s": predicted, "tokens_per_s": rate, "tokens": done * per_step,
                       "eval_losses": _eval_losses(text)})
        summary["stages"].append(record)
        save()
        if not res["ok"] or not (out / "model" / "config.json").is_file():
            # a failed stage (out of memory at 32K, say) is tried once at half the length, twice the rows, if
            # that is still longer than the stage before it and time is left
            half, before = length // 2, stages[i - 1][0] if i else 0
            if i not in retried and half > before and train_until - (time.monotonic() - dt.START) > 3 * overhead:
                retried.add(i)
                stages[i] = (half, 2 * rows)
                factors = stage_factors([n for n, _ in stages], original, a.context_ratio, max(a.lengths))
                dt.log(f"{name}: failed; trying {half} tokens x {2 * rows} rows instead")
                continue
            dt.log(f"{name}: dropped; the model so far is {init}")
            break
        init, measured = out / "model", (length, rows, rate or predicted)
        if "cut" not in record:
            overhead = max(overhead, res["wall_s"] - (steps - floor) * per_step / (_last_rate(text) or predicted))
        i += 1
    return init


def _last_rate(log_text: str) -> float | None:
    found = re.findall(r"([\d,]+) tok/s", log_text)
    return float(found[-1].replace(",", "")) if found else None


def _eval_losses(log_text: str) -> list[list[float]]:
    return [[int(s), float(v)] for s, v in re.findall(r"step (\d+): eval loss ([\d.]+)", log_text)]


def needle_only(model: Path, out: Path, a) -> dict:
    """The needle on `model`, one length at a time (shorter first), each with its trials cut to what is left of
    --needle-seconds at the previous length's time per prompt scaled by (length ratio)^1.6 (the CPU prefill's
    measured log-log slope was 1.55, docs/benchmarks.md); needle.json and needle.png rewritten after each."""
    sys.path.insert(0, str(ROOT / "bench"))
    from needle import heatmap  # bench/needle.py's heat-map

    from unmask.engine.llm import LLM
    from unmask.evaluation_needle import NeedleResult, report, table
    from unmask.train.corpus import read_documents

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(model, dtype=a.needle_dtype)
    docs = list(read_documents(Path(a.data) / "heldout.jsonl"))
    depths = [float(x) for x in a.depths.split(",")]
    entry: dict = {"model": str(model), "policy": a.needle_policy, "depths": depths, "results": [],
                   "trials_by_length": {}, "skipped": {}, "seconds_by_length": {}}
    per_prompt: tuple[int, float] | None = None
    for i, (length, trials) in enumerate(zip(a.lengths, a.trials)):
        left = a.needle_seconds - (time.monotonic() - t0)
        if per_prompt is not None:
            est = per_prompt[1] * (length / per_prompt[0]) ** 1.6
            trials = min(trials, int(left / (est * len(depths))))
        if trials < 1 or left <= 0:
            entry["skipped"][str(length)] = f"no time left ({left:.0f} s)"
            (out / "needle.json").write_text(json.dumps(entry, indent=1) + "\n")
            dt.log(f"needle {length}: skipped, {left:.0f} s left")
            continue
        t = time.monotonic()
        part = report(llm, docs, [length], depths, trials, a.needle_policy, seed=i)
        seconds = time.monotonic() - t
        per_prompt = (length, seconds / (trials * len(depths)))
        entry["results"] += part["results"]
        entry["trials_by_length"][str(length)] = trials
        entry["seconds_by_length"][str(length)] = round(seconds, 1)
        entry["configured_context"], entry["needle"] = part["configured_context"], part["needle"]
        cells = [NeedleResult(**{k: v for k, v in r.items() if k != "accuracy"}) for r in entry["results"]]
        entry["table"] = table(cells)
        counts = sorted(set(entry["trials_by_length"].values()))
        entry["trials"] = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        (out / "needle.json").write_text(json.dumps(entry, indent=1) + "\n")
        heatmap({**entry, "model": "/".join(Path(model).parts[-2:])}, out / "needle.png")  # "stage3/model"
        dt.log(f"needle {length}: {trials} per depth in {seconds:.0f} s\n{entry['table']}")
    return entry


def heldout_losses(name: str, model: Path, a, logs: Path, runs: Path) -> dict:
    """`unmask eval --limit 0 --chat-limit 0` on the CPU: the masked-token and next-token losses on 512-token
    held-out rows; on the CPU, as it was written and checked (the rows now follow the model's device, 555b7f0, but
    that path has not run on a GPU)."""
    out = runs / f"losses-{name}.json"
    res = run_cli(f"losses-{name}", ["eval", "-m", str(model), "--corpus", a.data, "--limit", "0", "--chat-limit", "0",
                                     "--sft-heldout", "none", "--policies", "threshold_0.9", "--dtype", "float32",
                                     "--json", str(out)], logs, timeout=300,
                  env=dict(runner_env(), UNMASK_DEVICE="cpu"))
    if res["ok"] and out.is_file():
        r = json.loads(out.read_text())
        res.update({k: r.get(k) for k in ("masked_token_loss", "next_token_loss")})
    return res


def gpu_name() -> str:
    """From nvidia-smi: torch.cuda.get_device_name would hold a CUDA context in this process for the whole run."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "cuda"


def quick_corpus(runs: Path, data: str) -> str:
    """--quick: a corpus of the first packages' files and a few held-out files, so each stage's re-packing and the
    evaluations take seconds on a CPU."""
    src, dst = ROOT / data, runs / "quick-corpus"
    dst.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.jsonl", 40), ("heldout.jsonl", 4)):
        with open(src / name) as f:
            lines = [line for _, line in zip(range(n), f)]
        (dst / name).write_text("".join(lines))
    return str(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=BUILT_IN, help="the model to continue (default: the built-in one)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "device-long-context")
    ap.add_argument("--runs", type=Path, default=None, help="scratch run directories (default: build/long-runs)")
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds from start by which everything, the evaluations included, must be done")
    ap.add_argument("--eval-reserve", type=float, default=120.0,
                    help="seconds kept from the training for the needle and the held-out losses")
    ap.add_argument("--stages", default=None, help="LENGTH:ROWS a step, per stage (default 2048:16,8192:4,32768:1; "
                    "--quick: 128:2,256:2,512:1)")
    ap.add_argument("--split", default=None,
                    help="shares of the training time, per stage (default 0.2,0.35,0.45: the first teaches the task, "
                         "as the 5.25M model's 1K needle went from 0%% to 100%% in 3,200 rows; the longer ones carry "
                         "it to distance; --quick: equal)")
    ap.add_argument("--context-ratio", type=float, default=4.0,
                    help="each stage's YaRN context as a multiple of its row length")
    ap.add_argument("--margin", type=float, default=0.85,
                    help="a predicted (not yet measured) stage's rate is taken as this share of the FLOPs model's")
    ap.add_argument("--startup", type=float, default=20.0,
                    help="seconds a stage's process takes besides its steps (start, data, export) until measured")
    ap.add_argument("--calibrate-steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--passkey-fraction", type=float, default=0.5,
                    help="share of passkey rows (the 5.25M model's 1K needle went from 0%% to 100%% with 0.5)")
    ap.add_argument("--data", default="data/corpus", help="corpus: training text, held-out haystack and losses")
    ap.add_argument("--needle-lengths", default="1024,4096,16384,65536,131072")
    ap.add_argument("--needle-trials", default="4,4,4,2,2", help="prompts per depth: one count, or one per length")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--needle-policy", default="threshold_0.9")
    ap.add_argument("--needle-dtype", default=None, help="the needle's model dtype (default: the engine's choice)")
    ap.add_argument("--needle-seconds", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage-seconds", type=float, default=None, help=argparse.SUPPRESS)  # a fixed limit (tests)
    ap.add_argument("--needle-only", type=Path, default=None, help="only the needle on this model directory")
    ap.add_argument("--quick", action="store_true", help="tiny stages, corpus and needle (CPU smoke run)")
    dt.add_join_args(ap)
    a = ap.parse_args()
    if a.join:
        dt.join_fetched(a, ap)
        return
    if a.quick:
        a.context_ratio, a.calibrate_steps = 8.0, 2
        a.needle_lengths, a.needle_trials, a.depths, a.deadline, a.eval_reserve = "256,1024", "1", "0,1", 600.0, 120.0
    a.stages = a.stages or ("128:2,256:2,512:1" if a.quick else "2048:16,8192:4,32768:1")
    if a.split is None:
        a.split = ",".join(["1"] * len(a.stages.split(","))) if a.quick else "0.2,0.35,0.45"
    try:
        parse_stages(a.stages)
        a.lengths = [int(x) for x in a.needle_lengths.split(",")]
        a.trials = parse_trials(a.lengths, a.needle_trials)
    except ValueError as e:
        ap.error(str(e))
    if a.needle_only is not None:
        a.needle_seconds = a.needle_seconds or 1e9
        needle_only(a.needle_only, a.out, a)
        return
    if not (a.model / "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there (a model directory)")
    a.model = a.model.resolve()
    runs = (a.runs or ROOT / "build" / "long-runs").resolve()
    logs = runs / "logs"
    a.out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    if a.quick:
        a.data = quick_corpus(runs, a.data)
    for need in (f"{a.data}/train.jsonl", f"{a.data}/heldout.jsonl"):
        if not (ROOT / need).is_file():
            raise SystemExit(f"{need} is missing: run `unmask corpus` (and carry data/ to the device machine)")
    import torch

    a.cuda = torch.cuda.is_available()
    summary: dict = {"model": str(a.model), "device": gpu_name() if a.cuda else "cpu",
                     "recipe": {k: getattr(a, k) for k in ("stages", "split", "lr", "passkey_fraction", "data",
                                                           "deadline", "needle_policy")}}

    def save() -> None:
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    final = run_stages(a, runs, logs, summary, save)
    summary["final_model"] = str(final)
    summary["trained"] = final != a.model
    dt.export_bf16_shards(final, runs / "export")
    summary["shards"] = dt.package(runs / "export", logs, a.out)
    save()
    dt.log(f"packaged {final}: {summary['shards']}")

    a.needle_seconds = a.deadline - (time.monotonic() - dt.START) - LOSS_RESERVE_S - 10.0
    args = [sys.executable, str(Path(__file__).resolve()), "--needle-only", str(final), "--out", str(a.out),
            "--data", a.data, "--needle-lengths", a.needle_lengths, "--needle-trials", ",".join(map(str, a.trials)),
            "--depths", a.depths, "--needle-policy", a.needle_policy, "--needle-seconds", f"{a.needle_seconds:.0f}"]
    if a.needle_dtype:
        args += ["--needle-dtype", a.needle_dtype]
    t0 = time.monotonic()
    dt.log(f"needle: {a.needle_seconds:.0f} s for it")
    with open(logs / "needle.log", "w") as f:
        try:
            p = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=runner_env(), cwd=ROOT,
                               timeout=max(30.0, a.needle_seconds + 30.0))
            summary["needle_error"] = f"exit {p.returncode}" if p.returncode else None
        except subprocess.TimeoutExpired:
            summary["needle_error"] = "timed out (needle.json holds the lengths that finished)"
    summary["needle_s"] = round(time.monotonic() - t0, 1)
    if (a.out / "needle.json").is_file():
        n = json.loads((a.out / "needle.json").read_text())
        summary["needle"] = {f"{c['length']}@{c['depth']}": c["accuracy"] for c in n["results"]}
        summary["needle_skipped"] = n["skipped"]
        dt.log(f"needle:\n{n.get('table', '(no length finished)')}")
    else:
        dt.log(f"needle: no result ({summary['needle_error']}); see logs/needle.log")
    save()

    summary["losses"] = {"start": heldout_losses("start", a.model, a, logs, runs)}
    if final != a.model:
        summary["losses"]["final"] = heldout_losses("final", final, a, logs, runs)
    with tarfile.open(a.out / "meta.tar.gz", "w:gz") as tar:  # again, now with the evaluations' logs
        export = runs / "export"
        shards = set(json.loads((export / "model.safetensors.index.json").read_text())["weight_map"].values())
        for f in sorted(export.iterdir()):
            if f.name not in shards:   # as dt.package: the shards come back beside it, other files (a table) in it
                tar.add(f, arcname=f"model/{f.name}")
        for f in sorted(logs.glob("*.log")):
            tar.add(f, arcname=f"logs/{f.name}")
    summary["total_s"] = round(time.monotonic() - dt.START, 1)
    save()
    dt.log(f"done in {summary['total_s']:.0f} s: losses {json.dumps(summary['losses'])}")
    if len(list(a.out.iterdir())) > 8:
        dt.log(f"warning: {len(list(a.out.iterdir()))} files in {a.out}; a device call brings back 8")


if __name__ == "__main__":
    main()
