"""Train a larger built-in model on a lent GPU within one device call: `make model`'s three phases, timed.

    python scripts/device_train.py --out $OUT --minutes 8          # on a lent GPU machine (docs/training.md:
                                                                   # how to carry the data within 64 MiB)
    python scripts/device_train.py --quick --out /tmp/dt           # the same code path on this CPU (smoke run)
    python scripts/device_train.py --steps 1349,3088,712 ...       # repeat a recorded run (`make model`)

Why: the 5.25M-parameter model that 3 h 20 min of 2 CPU cores trained (`make model-5m`) writes Python-shaped
but wrong code. On one H200 this script trained the shipped 19.9M-parameter unmask-tiny in two calls
(2026-12-04, docs/model-card.md): 8 min with --deadline 500, then 4 min more with --continue-from.
The phases are `make model-5m`'s (data from `unmask corpus`): a causal next-token base, block diffusion with a
causal context from it, then SFT with 25% corpus replay. A short calibration run of the base measures
tokens/s; each phase then gets the steps that fit its share of --minutes, or with --deadline of the time
actually left at the previous phase's measured rate (warmup, eval and save intervals scaled to the steps).
--steps skips both and repeats a recorded run.

The device machine has no `unmask` install: the phases run as `python -m unmask.cli ...` with src/ on
PYTHONPATH. A device call brings back at most 8 files of 16 MiB, so --out gets the final model's weights in
bfloat16 as safetensors shards of at most 15 MiB, `meta.tar.gz` (the rest of the model directory and the
phases' logs) and `summary.json`. `python scripts/device_train.py --join FETCHED_DIR --to MODEL_DIR` makes the
model directory with one model.safetensors, as the shipped model has it.
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

ROOT = Path(__file__).resolve().parents[1]
SHARD_BYTES = 15 * 1024 * 1024
PACKAGE_S = 20.0   # --deadline: export + packaging allowance
STARTUP_S = 15.0   # --deadline: each phase's process start, model load and data set-up
START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:7.1f}s] {msg}", flush=True)


def run(name: str, args: list[str], logs: Path) -> tuple[float, list[float]]:
    """Runs one `unmask` command; returns (wall seconds, the tokens/s figures its log lines reported)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                               if p]),
               HF_HUB_OFFLINE="1")  # tokenizers may use every core: nothing forks after it
    t0 = time.monotonic()
    log(f"{name}: unmask {' '.join(args)}")
    with open(logs / f"{name}.log", "w") as f:
        p = subprocess.run([sys.executable, "-m", "unmask.cli", *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                           cwd=ROOT)
    text = (logs / f"{name}.log").read_text()
    if p.returncode:
        raise SystemExit(f"{name} failed (exit {p.returncode}):\n{text[-3000:]}")
    tps = [float(x.replace(",", "")) for x in re.findall(r"([\d,]+) tok/s", text)]
    wall = time.monotonic() - t0
    log(f"{name}: {wall:.0f} s, last tokens/s {tps[-1] if tps else 'n/a'}; tail: {text.strip().splitlines()[-1][:200]}")
    return wall, tps


def steady_rate(log_text: str, tokens_per_step: int) -> float | None:
    """Tokens/s between the last two progress lines of a phase's log. The trainer prints the average since
    its start, which counts the warm-up: on the H200 a 30-step calibration averaged 283K tokens/s while its
    last 10 steps ran at 726K, the rate the base phase then kept (731K)."""
    points = [(int(a), float(b.replace(",", ""))) for a, b in re.findall(r"step (\d+)/\d+ .*?([\d,]+) tok/s", log_text)]
    if len(points) < 2 or points[-1][0] <= points[-2][0]:
        return None
    (s1, r1), (s2, r2) = points[-2:]
    t1, t2 = s1 * tokens_per_step / r1, s2 * tokens_per_step / r2  # seconds since the start, from the averages
    return (s2 - s1) * tokens_per_step / (t2 - t1) if t2 > t1 else None


def share_token_cache(run_dir: Path, cache: Path) -> None:
    """Point run_dir/tokens at one cache, so the phases tokenize the corpus once between them (the cache is
    keyed by file and tokenizer, so sharing it is safe)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    link = run_dir / "tokens"
    if not link.is_symlink():
        if link.is_dir():
            shutil.rmtree(link)
        link.symlink_to(cache.resolve(), target_is_directory=True)


def steps_for(seconds: float, tps: float, rows: int, seq_len: int, floor: int) -> int:
    return max(floor, int(seconds * tps / (rows * seq_len)))


def plan_steps(deadline: float, elapsed: float, phases_left: int, share: float, shares_left: float, rate: float,
               rows: int, seq_len: int) -> tuple[float, int]:
    """--deadline: the seconds and steps the next phase gets: its share of the time left once packaging and a
    start-up allowance per remaining phase are set aside, at `rate` tokens/s (at least 20 steps)."""
    left = deadline - elapsed - PACKAGE_S - STARTUP_S * phases_left
    seconds = max(0.0, left) * share / shares_left
    return seconds, steps_for(seconds, rate, rows, seq_len, 20)


def schedule(steps: int) -> list[str]:
    return ["--steps", str(steps), "--warmup", str(max(1, steps // 20)), "--eval-every", str(max(1, steps // 5)),
            "--save-every", str(max(1, steps // 4))]


def export_bf16_shards(src: Path, dst: Path, prefix: str = "model") -> list[str]:
    """The model directory with its weights cast to bfloat16 and split into <= 15 MiB safetensors shards."""
    import torch
    from safetensors.torch import load_file, save_file

    from unmask.models.loader import weight_files

    dst.mkdir(parents=True, exist_ok=True)
    weights = weight_files(src)   # the loader's own list: other .safetensors (the n-gram draft table) are files
    for f in src.iterdir():
        if f.is_file() and f not in weights and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    state = {}
    for f in weights:
        state.update(load_file(f))
    shards: list[dict] = [{}]
    size = 0
    for name, t in state.items():
        t = t.to(torch.bfloat16) if t.is_floating_point() else t
        nbytes = t.numel() * t.element_size()
        if nbytes > SHARD_BYTES:
            raise SystemExit(f"{name}: {nbytes:,} bytes, more than one shard may hold ({SHARD_BYTES:,})")
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, dst / fname, metadata={"format": "pt"})
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=1) + "\n")
    cfg_path = dst / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        cfg["torch_dtype"] = "bfloat16"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return names


def package(model_dir: Path, logs: Path, out: Path, base_dir: Path | None = None) -> list[str]:
    """out/: the shards as they are, and meta.tar.gz with the model directory's other files (under model/; the
    causal base's under base/, with --keep-base) and the logs."""
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with tarfile.open(out / "meta.tar.gz", "w:gz") as tar:
        for arc, d in (("model", model_dir), ("base", base_dir)):
            shards = set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()) \
                if d is not None else set()
            for f in sorted(d.iterdir()) if d is not None else ():
                if f.name in shards:
                    shutil.copy2(f, out / f.name)
                    names.append(f.name)
                else:
                    tar.add(f, arcname=f"{arc}/{f.name}")
        for f in sorted(logs.glob("*.log")):
            tar.add(f, arcname=f"logs/{f.name}")
    return names


def join_shards(fetched: Path, dst: Path, which: str = "model") -> None:
    """A fetched --out (shards + meta.tar.gz) -> a model directory with one model.safetensors (`which`:
    "model", or "base" for the causal base that --keep-base brought back)."""
    from safetensors.torch import load_file, save_file

    with tarfile.open(fetched / "meta.tar.gz") as tar:
        tar.extractall(dst.parent / (dst.name + ".meta"), filter="data")
    meta = dst.parent / (dst.name + ".meta")
    dst.mkdir(parents=True, exist_ok=True)
    if not (meta / which).is_dir():
        raise SystemExit(f"{fetched}: no {which}/ in meta.tar.gz (the base comes back only with --keep-base)")
    index = meta / which / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state = {}
    for f in files:
        state.update(load_file(fetched / f))
    for f in (meta / which).iterdir():
        if f.name != index.name:
            shutil.copy2(f, dst / f.name)
    tmp = dst / "model.safetensors.tmp"
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, dst / "model.safetensors")
    print(f"{dst}: {len(state)} tensors from {len(files)} shards; logs in {meta / 'logs'}")


def add_join_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--join", type=Path, help="a fetched --out: write the model directory --to and exit")
    ap.add_argument("--to", type=Path, help="with --join: the model directory to write")


def join_fetched(a, ap: argparse.ArgumentParser) -> None:
    """--join FETCHED --to MODEL_DIR (this script's and device_distill.py's way back from a device call)."""
    if a.to is None:
        ap.error("--join needs --to MODEL_DIR")
    join_shards(a.join, a.to)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "device-train")
    ap.add_argument("--runs", type=Path, default=None, help="scratch run directories (default: build/device-runs)")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time over the three phases")
    ap.add_argument("--split", default="0.45,0.35,0.2", help="shares of --minutes: base, block diffusion, SFT")
    ap.add_argument("--cost", default="1,2,2", help="each phase's time per token relative to the causal base "
                    "(block diffusion with a causal context runs the clean and the noisy stream: 2L tokens a row)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start by which the run must be packaged: each phase's steps are re-planned "
                         "from the time left and the rate the previous phase measured (--minutes is then unused)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3, help="base phase; block diffusion uses 2/3, SFT 1/3 of it")
    ap.add_argument("--max-epochs", type=float, default=8.0,
                    help="passes over the corpus at most, per pre-training phase (the time budget may allow more)")
    ap.add_argument("--data", default="data/corpus", help="pre-training corpus (e.g. data/corpus-torch from "
                    "`unmask corpus --package torch --out data/corpus-torch`: 2.5x the text)")
    ap.add_argument("--continue-from", type=Path, default=None,
                    help="a model this script made: skip calibration and the causal base, run block diffusion "
                         "and SFT again from it (a second device call that carries the first one's model)")
    ap.add_argument("--rate", type=float, default=None,
                    help="with --continue-from: the block-diffusion tokens/s the first call measured")
    ap.add_argument("--steps", default=None,
                    help="fixed steps per phase, comma-separated (base,adapt,sft; with --continue-from adapt,sft): "
                         "repeat a recorded run (`make model`) with no calibration or time planning")
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps per phase (CPU smoke run)")
    ap.add_argument("--keep-base", action="store_true",
                    help="also bring back the causal base (bf16 shards base-*.safetensors), which a compute-matched "
                         "AR twin starts from; --join ... --base-to DIR writes it")
    add_join_args(ap)
    ap.add_argument("--base-to", type=Path, help="with --join: also write the causal base (--keep-base) here")
    a = ap.parse_args()
    if a.join:
        join_fetched(a, ap)
        if a.base_to is not None:
            join_shards(a.join, a.base_to, which="base")
        return
    try:
        fixed = [int(x) for x in a.steps.split(",")] if a.steps else None
    except ValueError:
        ap.error(f"--steps {a.steps!r}: comma-separated whole numbers")
    if fixed is not None and len(fixed) != (2 if a.continue_from is not None else 3):
        ap.error("--steps takes one count per phase: base,adapt,sft (adapt,sft with --continue-from)")
    if a.continue_from is not None:
        if fixed is None and (a.deadline is None or a.rate is None):
            ap.error("--continue-from needs --steps, or --deadline and --rate")
        if not (a.continue_from / "config.json").is_file():
            ap.error(f"--continue-from {a.continue_from}: no config.json there (a model directory, e.g. --join's)")
        a.continue_from = a.continue_from.resolve()  # the phases run from the repository root
    if fixed is not None:
        a.deadline = None
    a.fixed = fixed
    if a.quick:
        a.hidden, a.layers, a.heads, a.kv_heads, a.head_dim, a.intermediate = 64, 2, 4, 2, 16, 128
        a.batch_size, a.seq_len = 4, 128
    if not a.quick:
        import torch

        if not torch.cuda.is_available():  # `make model` on a laptop: say what it is in for before hours pass
            log("warning: no CUDA device, so every phase runs on the CPU: the shipped recipe trained for ~12 min "
                "on an H200 and is estimated at ~4 days on 2 CPU cores (docs/model-card.md)")
    for need in (f"{a.data}/train.jsonl", "data/sft/train.jsonl", "data/tokenizer/tokenizer.json"):
        if not (ROOT / need).is_file():
            raise SystemExit(f"{need} is missing: run `unmask corpus` (and carry data/ to the device machine)")
    runs = a.runs or ROOT / "build" / "device-runs"
    logs = runs / "logs"
    a.out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    shape = ["--hidden", str(a.hidden), "--layers", str(a.layers), "--heads", str(a.heads), "--kv-heads",
             str(a.kv_heads), "--head-dim", str(a.head_dim), "--intermediate", str(a.intermediate)]
    rows = ["--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len)]
    data = ["--data", a.data]
    shares = [float(x) for x in a.split.split(",")]
    budget = [a.minutes * 60 * s / sum(shares) for s in shares]
    summary: dict = {"shape": shape, "rows": rows, "data": a.data, "minutes": a.minutes}

    for phase in ("calibrate", "base", "adapt", "sft"):
        share_token_cache(runs / phase, runs / "token-cache")
    cost = [float(x) for x in a.cost.split(",")]
    if a.continue_from is not None:
        continue_run(a, runs, logs, rows, data, shares, summary)
        return
    if fixed is not None:
        n, rate = fixed, None
    else:
        n, rate = calibrate(a, runs, logs, shape, rows, data, budget, cost, summary)
    summary["steps"] = n

    phases = [("base", base_args(a, runs, shape, rows, data)),
              ("adapt", adapt_args(a, runs, runs / "base" / "model", rows, data)),
              ("sft", sft_args(a, runs, rows))]
    phases = [(name, [*args, *schedule(n[i])]) for i, (name, args) in enumerate(phases)]
    measured = {"base": rate}  # tokens/s each phase's log reported last (a phase's rate predicts the next one's)
    for i, (name, args) in enumerate(phases):
        if a.deadline is not None and not a.quick:
            # re-plan this phase from the time actually left: its share of what remains, at the rate the
            # previous phase measured (scaled by the cost ratio), less a start-up allowance per phase left
            prev = list(measured.values())[-1]
            prev_cost = cost[i - 1] if i else 1.0
            seconds, steps = plan_steps(a.deadline, time.monotonic() - START, len(phases) - i, shares[i],
                                        sum(shares[i:]), prev * prev_cost / cost[i], a.batch_size, a.seq_len)
            if i < 2 and "epoch_cap_steps" in summary:
                steps = min(steps, summary["epoch_cap_steps"])
            n[i] = steps
            args = [x for x in args]
            j = args.index("--steps")
            args[j:j + 8] = schedule(steps)
            log(f"{name}: {seconds:.0f} s left for it at ~{prev * prev_cost / cost[i]:,.0f} tokens/s -> {steps} steps")
            summary["steps"] = n
        wall, tps = run(name, args, logs)
        rate_now = steady_rate((logs / f"{name}.log").read_text(), a.batch_size * a.seq_len)
        if rate_now or tps:
            measured[name] = rate_now or tps[-1]
        summary[name] = {"wall_s": wall, "tokens_per_s_last": tps[-1] if tps else None,
                         "tokens": n[i] * a.batch_size * a.seq_len}
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    finish(a, runs, logs, summary)


def calibrate(a, runs: Path, logs: Path, shape, rows, data, budget, cost, summary: dict) -> tuple[list[int], float]:
    """A short run of the base measures tokens/s on this machine (its first steps pay for start-up and allocation);
    each phase gets the steps that fit its budget, the pre-training phases at most --max-epochs passes."""
    cal_steps = 4 if a.quick else 30
    _, tps = run("calibrate", ["train", "--objective", "causal", "--out", str(runs / "calibrate"), "--overwrite",
                               *data, *shape, *rows, "--steps", str(cal_steps), "--warmup", "2", "--eval-every", "0",
                               "--save-every", "0"], logs)
    steady = steady_rate((logs / "calibrate.log").read_text(), a.batch_size * a.seq_len)
    rate = steady or (tps[-1] if tps else 1000.0)
    summary["calibration_tokens_per_s"], summary["calibration_average_tokens_per_s"] = rate, tps[-1] if tps else None
    n = [3, 3, 3] if a.quick else [steps_for(b, rate / c, a.batch_size, a.seq_len, 50) for b, c in zip(budget, cost)]
    # a data-bound corpus: cap the pre-training phases at --max-epochs passes over its rows (more overfits a
    # model of this size; the held-out losses in the logs show whether the cap was right)
    found = re.findall(r"([\d,]+) rows x", (logs / "calibrate.log").read_text())
    if found and not a.quick:
        rows_in_corpus = int(found[0].replace(",", ""))
        cap = max(50, int(a.max_epochs * rows_in_corpus / a.batch_size))
        n = [min(n[0], cap), min(n[1], cap), n[2]]
        summary["corpus_rows"], summary["epoch_cap_steps"] = rows_in_corpus, cap
    return n, rate


def base_args(a, runs: Path, shape, rows, data) -> list[str]:
    return ["train", "--objective", "causal", "--out", str(runs / "base"), "--overwrite", *data, *shape, *rows,
            "--lr", str(a.lr)]


def adapt_args(a, runs: Path, init: Path, rows, data) -> list[str]:
    return ["train", "--init-from", str(init), "--out", str(runs / "adapt"), "--overwrite", "--causal-context",
            *data, *rows, "--lr", str(a.lr * 2 / 3)]


def sft_args(a, runs: Path, rows) -> list[str]:
    return ["finetune", "--model", str(runs / "adapt" / "model"), "--data", "data/sft/train.jsonl", "--eval-data",
            "data/sft/heldout.jsonl", "--out", str(runs / "sft"), "--overwrite", *rows, "--pack", "--mix-text",
            a.data, "--mix-fraction", "0.25", "--lr", str(a.lr / 3)]


def continue_run(a, runs: Path, logs: Path, rows, data, shares, summary: dict) -> None:
    """Block diffusion then SFT again from --continue-from, with --steps or each planned from the time left (both
    phases run two streams a row, so one rate serves both)."""
    phases = [("adapt", shares[1], adapt_args(a, runs, a.continue_from, rows, data)),
              ("sft", shares[2], sft_args(a, runs, rows))]
    rate = a.rate
    summary["continue_from"] = str(a.continue_from)
    summary["shape"] = f"that of {a.continue_from}"  # the shape flags do not apply: the model has its own
    for i, (name, share, args) in enumerate(phases):
        if a.fixed is not None:
            steps = a.fixed[i]
        else:
            seconds, steps = plan_steps(a.deadline, time.monotonic() - START, len(phases) - i, share,
                                        sum(p[2] for p in phases[i:]), rate, a.batch_size, a.seq_len)
            log(f"{name}: {seconds:.0f} s left for it at ~{rate:,.0f} tokens/s -> {steps} steps")
        wall, tps = run(name, [*args, *schedule(steps)], logs)
        rate = steady_rate((logs / f"{name}.log").read_text(), a.batch_size * a.seq_len) or (tps[-1] if tps else rate)
        summary[name] = {"wall_s": wall, "tokens_per_s_last": tps[-1] if tps else None,
                         "tokens": steps * a.batch_size * a.seq_len}
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    finish(a, runs, logs, summary)


def finish(a, runs: Path, logs: Path, summary: dict) -> None:
    model_src = runs / "sft" / "model"
    gen = model_src / "generation_config.json"
    if gen.is_file():  # the defaults `make model` writes (docs/model-card.md, "Penalties against the loops" and
        g = json.loads(gen.read_text())   # "Default policy")
        g["chat_defaults"] = {"frequency_penalty": 0.5}
        g["default_policy"] = {"policy": "speculative", "block_size": 4, "draft_lookup": 8}
        gen.write_text(json.dumps(g, indent=2) + "\n")
    export_bf16_shards(model_src, runs / "export")
    base = None
    if a.keep_base and a.continue_from is None:  # the AR twin's starting point (scripts/train_ar_twin.py --init-from)
        base = runs / "export-base"
        export_bf16_shards(runs / "base" / "model", base, prefix="base")
    summary["shards"] = package(runs / "export", logs, a.out, base)
    summary["total_s"] = time.monotonic() - START
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"done: {json.dumps(summary)}")


if __name__ == "__main__":
    main()
