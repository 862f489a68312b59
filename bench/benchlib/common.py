"""Shared pieces of the benchmark suite: interleaved repetitions, summaries, peak memory, the machine.

Interleaving: every comparison in the suite runs its variants in the same process, alternating
(A B C A B C ...), with the order rotated by one each round so no variant always runs first or
last. A ratio is computed *within* each round (A_r / B_r) and reported as the median with min and
max over the rounds, so a neighbour that loads the shared cores for a while slows A and B alike.
"""
from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- statistics

def summary(values: Sequence[float]) -> dict:
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def ratio_summary(num: Sequence[float], den: Sequence[float]) -> dict:
    """Per-round ratios num[r] / den[r] of runs interleaved in the same round."""
    return summary([a / b for a, b in zip(num, den) if a is not None and b])


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def rotated(items: Sequence, k: int) -> list:
    k %= max(len(items), 1)
    return list(items[k:]) + list(items[:k])


def interleave(variants: Sequence[str], rounds: int, run: Callable[[str, int], dict],
               log: Callable[[str], None] | None = None) -> dict[str, list[dict]]:
    """run(variant, round) for every variant in every round, order rotated each round."""
    out: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in rotated(variants, r):
            out[v].append(run(v, r))
        if log:
            log(f"  round {r + 1}/{rounds} done")
    return out


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def loglog_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """(slope, intercept) of log y = slope * log x + intercept."""
    s = loglog_slope(xs, ys)
    if s is None:
        return None
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    return s, sum(p[1] - s * p[0] for p in pts) / len(pts)


def with_long_prefill(pre: dict, long: dict | None) -> dict:
    """The report's cost section: the prefill curve with the opt-in long prefills' rows appended (lengths it lacks) and refitted."""
    if not long:
        return pre
    have = {r["length"] for r in pre["rows"]}
    rows = sorted(pre["rows"] + [r for r in long["prefill"]["rows"] if r["length"] not in have],
                  key=lambda r: r["length"])
    fits = {}
    for k, f in pre["fits"].items():
        pts = [(r["length"], r[k]["median"]) for r in rows if r.get(k) and r[k].get("median")]
        fit = loglog_fit([x for x, _ in pts], [y for _, y in pts])
        half = pts[len(pts) // 2:]
        upper = loglog_fit([x for x, _ in half], [y for _, y in half]) if len(pts) >= 4 else None
        fits[k] = {"slope": fit[0] if fit else None, "intercept": fit[1] if fit else None,
                   "slope_upper_half": upper[0] if upper else None, "slope_per_round": f.get("slope_per_round")}
    return {"rows": rows, "fits": fits}


# ---------------------------------------------------------------------------------------------- memory

class PeakMemory:
    """Peak resident memory of one measured region of this process (Linux).

    Before the region: collect garbage, hand all freed heap back to the kernel (glibc malloc_trim, which
    also releases free pages inside the heap) and reset the kernel's high-water mark (write 5 to
    /proc/self/clear_refs). After: VmHWM - the RSS at the start, i.e. what the region itself needed.
    """

    def __init__(self):
        self.ok = os.path.exists("/proc/self/clear_refs")
        self._libc = None
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:
            pass
        self.base_kb = 0

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        return 0

    def start(self) -> None:
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        if self.ok:
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
            except OSError:
                self.ok = False
        self.base_kb = self._status("VmRSS") if self.ok else 0

    def stop(self) -> dict:
        if not self.ok:
            return {"peak_rss_mb": None, "delta_mb": None}
        peak = self._status("VmHWM")
        return {"peak_rss_mb": peak / 1024, "delta_mb": (peak - self.base_kb) / 1024}


# ---------------------------------------------------------------------------------------------- machine

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return None


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    import torch

    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "cpu": _cpu_model(), "cores": cores, "logical_cpus": os.cpu_count(), "memory_gb": _mem_total_gb(),
        "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(), "transformers": tf,
        "git": f"{commit}{' (uncommitted changes)' if dirty else ''}" if commit else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average_start": load_average(),
    }


def python_cmd() -> str:
    """How to spell this interpreter in a reproduction command (relative to the repository)."""
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(ROOT))
    except ValueError:
        return "python"


def write_json(path: Path | str, doc, *, indent: int = 1, default=None) -> Path:
    """The results file of a bench script (--json and the like): `doc` as indented JSON plus a newline, its
    folder created first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, default=default) + "\n")
    return path
