"""Training on glibc's allocator against jemalloc (src/unmask/allocator.py), interleaved A B A B.

    python bench/allocator.py [--length 8192] [--train-steps 30] [--rounds 2] [--json OUT]

Two measurements, each in fresh processes, alternating glibc and jemalloc (LD_PRELOAD with purging off, as the
training commands set it):
- one long row: three training steps of one --length row (bench/two_stream_step.py's step: split attention, block
  8, bf16 autocast, activation checkpointing as the long stages run, the trainer's malloc_trim after each step),
  seconds, system CPU seconds and minor page faults of each step, and the peak RSS;
- short rows: `unmask train --init-from` the built-in model, --train-steps steps of 16 x 256, the tokens/s of its
  last log line, the elapsed and system seconds and the peak RSS (GNU time), and the losses (they must agree).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from unmask.allocator import KEEP_PAGES, find_jemalloc  # noqa: E402


def env_for(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    if name == "jemalloc":
        # the same environment the training commands give themselves; the marker stops a second exec
        env.update(LD_PRELOAD=find_jemalloc(), MALLOC_CONF=KEEP_PAGES, UNMASK_ALLOCATOR_REEXEC="1")
    else:
        env["UNMASK_ALLOCATOR"] = "glibc"
    return env


def child_long_row(length: int) -> None:
    import resource

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import two_stream_step as t
    from unmask.allocator import active
    from unmask.train.heap import trim
    from unmask.train.trainer import checkpoint_blocks

    torch.set_num_threads(2)
    model, spec, obj = t._setup(None, 8)
    checkpoint_blocks(model)
    steps = []
    for seed in range(3):
        r0, s = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        t._step(model, spec, obj, length, 8, True, seed)
        trim()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        steps.append({"s": round(time.perf_counter() - s, 2), "sys_s": round(r1.ru_stime - r0.ru_stime, 2),
                      "minflt": r1.ru_minflt - r0.ru_minflt})
    print(json.dumps({"allocator": active(), "steps": steps,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))


def long_row(name: str, length: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child-length", str(length)], env=env_for(name),
                       capture_output=True, text=True, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["allocator"] == name, out
    return out


def short_rows(name: str, steps: int, tmp: Path) -> dict:
    unmask = str(Path(sys.executable).with_name("unmask"))
    cmd = ["/usr/bin/time", "-f", "TIME %M %e %S", unmask, "train", "--init-from", "src/unmask/assets/unmask-tiny",
           "--out", str(tmp / name), "--overwrite", "--steps", str(steps), "--batch-size", "16", "--seq-len", "256",
           "--warmup", "2", "--eval-every", "0", "--save-every", "100000"]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    if name == "glibc":
        env["UNMASK_ALLOCATOR"] = "glibc"
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    text = (r.stdout + r.stderr).replace("\r", "\n")
    assert (", jemalloc" in text) == (name == "jemalloc"), text[-2000:]
    rss_kb, elapsed, system = re.findall(r"TIME (\d+) (\S+) (\S+)", text)[-1]
    rates = re.findall(r"step \d+/\d+ loss \S+ lr \S+ ([\d,]+) tok/s", text)
    return {"tokens_per_s": int(rates[-1].replace(",", "")), "elapsed_s": float(elapsed), "sys_s": float(system),
            "peak_rss_mb": int(rss_kb) // 1024, "losses": re.findall(r"step \d+/\d+ loss (\S+)", text)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192, help="the long row (0: skip)")
    ap.add_argument("--train-steps", type=int, default=30, help="short-row training steps (0: skip)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child-length", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_length:
        return child_long_row(args.child_length)
    if find_jemalloc() is None:
        sys.exit("libjemalloc2 is not installed (Debian: apt-get install libjemalloc2; make setup does as root)")
    results: dict = {"command": " ".join(sys.argv), "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                     "long_row": [], "short_rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in ("glibc", "jemalloc"):
                if args.length:
                    out = {"round": rnd, "allocator": name, **long_row(name, args.length)}
                    results["long_row"].append(out)
                    print(json.dumps(out), flush=True)
                if args.train_steps:
                    out = {"round": rnd, "allocator": name, **short_rows(name, args.train_steps, Path(tmp))}
                    results["short_rows"].append(out)
                    print(json.dumps({k: v for k, v in out.items() if k != "losses"}), flush=True)
    if args.train_steps:
        losses = {json.dumps(r["losses"]) for r in results["short_rows"]}
        print("short-row losses identical across allocators and rounds:", len(losses) == 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
