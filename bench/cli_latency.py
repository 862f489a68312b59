"""Wall-clock latency of `unmask generate` as a user sees it: process start to the echoed prompt, to the first
answer text, and to exit (the answer streams as blocks commit).

    python bench/cli_latency.py [--runs 3] [--prompt "def fibonacci(n):"] [-- extra generate flags]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

UNMASK = Path(sys.executable).with_name("unmask")


def one_run(prompt: str, extra: list[str]) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    p = subprocess.Popen([str(UNMASK), "generate", prompt, *extra], stdout=subprocess.PIPE, bufsize=0)
    echoed = first = None
    seen = 0
    while chunk := p.stdout.read(1):
        now = time.perf_counter() - t0
        seen += len(chunk)
        if echoed is None:
            echoed = now
        if first is None and seen > len(prompt.encode()):
            first = now
    if p.wait():
        raise SystemExit(f"unmask generate exited with {p.returncode}")
    done = time.perf_counter() - t0
    return echoed or done, first or done, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("extra", nargs="*", help="flags passed on to `unmask generate` (after --)")
    a = ap.parse_args()
    rows = [one_run(a.prompt, a.extra) for _ in range(a.runs)]
    for name, i in (("prompt echoed", 0), ("first answer text", 1), ("exit", 2)):
        xs = [r[i] for r in rows]
        print(f"{name:<18} median {statistics.median(xs):.2f} s [{min(xs):.2f}-{max(xs):.2f}] over {a.runs} runs")


if __name__ == "__main__":
    main()
