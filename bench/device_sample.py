"""Memory and time of the static step's sampler at a Qwen3-sized vocabulary: the sort-free `sample_rows`
(decoding/device_sample.py, in its slices of SLICE_ROWS_CPU rows, and with all rows in one slice) against the
sort-based one it replaced (tests/sorted_sampling_reference.py), on the CPU.

For each row count N, on logits [N, V] (float32, randn x 3, seeded), temperature 0.8, top_k 0, top_p 0.95 (the
device check's sampled setting; both samplers do the same work whatever the settings):
- peak torch memory of one call: every allocation torch's CPU allocator made during it, operators' internal scratch
  included (the profiler's allocation events, summed in time order; the input and the outputs' final size aside),
  and the process's peak RSS growth over the call (VmHWM after the high-water mark is reset; benchlib.PeakMemory);
- time per call: the two samplers alternated A B A B for --rounds rounds after one warm-up call each; median and
  min-max, the load average before and after.
On a GPU the sort's scratch is cub's radix-sort buffers instead of the CPU's, so the bytes differ there; this
measures the temporaries of the two algorithms as torch allocates them on the CPU.

    OMP_WAIT_POLICY=PASSIVE nice -n 19 .venv/bin/python bench/device_sample.py --rows 1,16,64 --rounds 5 \\
        --json docs/bench/device-sample.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchlib.common import PeakMemory, load_average, machine, write_json  # noqa: E402
from sorted_sampling_reference import sorted_sample_rows  # noqa: E402
from unmask.decoding import device_sample  # noqa: E402


def sort_free_one_slice(logits, *args):
    """The sort-free sampler with every row in one slice (device_sample.SLICE_ROWS_CPU raised to N)."""
    kept = device_sample.SLICE_ROWS_CPU
    device_sample.SLICE_ROWS_CPU = logits.shape[0]
    try:
        return device_sample.sample_rows(logits, *args)
    finally:
        device_sample.SLICE_ROWS_CPU = kept


SAMPLERS = {"sorted": sorted_sample_rows, "sort_free": device_sample.sample_rows,
            "sort_free_one_slice": sort_free_one_slice}


def inputs(n: int, v: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g).mul_(3)
    return (logits, torch.full((n,), 0.8), torch.zeros(n, dtype=torch.long), torch.full((n,), 0.95),
            torch.rand(n, generator=g, dtype=torch.float64))


def allocation_peak(fn, args) -> int:
    """Bytes: the most torch held at once during fn(*args) beyond what it held before (profiler allocation events,
    which c10's CPU allocator reports for every allocation and free, inside operators too)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args)
        del out
    events = []

    def walk(node) -> None:
        if node.tag == torch._C._profiler._EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        live += size
        peak = max(peak, live)
    return peak


def rss_growth(fn, args) -> float | None:
    """MiB: the process's peak RSS over the call above its RSS before it."""
    mem = PeakMemory()
    mem.start()
    out = fn(*args)
    got = mem.stop()["delta_mb"]
    del out
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64", help="row counts N, comma-separated")
    ap.add_argument("--vocab", type=int, default=151_936, help="V (Qwen3's vocabulary)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    ap.add_argument("--json", default="docs/bench/device-sample.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    doc = {"machine": machine(), "command": " ".join(sys.argv), "vocab": args.vocab,
           "slice_rows_cpu": device_sample.SLICE_ROWS_CPU,
           "settings": {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "logits": "randn x 3, float32"},
           "results": []}
    for n in (int(x) for x in args.rows.split(",")):
        data = inputs(n, args.vocab)
        input_mb = data[0].numel() * 4 / 2**20
        row = {"rows": n, "logits_mib": round(input_mb, 1), "load_average_before": load_average()}
        for name, fn in SAMPLERS.items():
            fn(*data)  # warm-up
            row[f"{name}_alloc_peak_mib"] = round(allocation_peak(fn, data) / 2**20, 1)
            row[f"{name}_rss_growth_mib"] = rss_growth(fn, data)
        times = {name: [] for name in SAMPLERS}
        for _ in range(args.rounds):
            for name, fn in SAMPLERS.items():  # interleaved: A B A B
                t0 = time.perf_counter()
                fn(*data)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            row[f"{name}_ms"] = {"median": round(1e3 * statistics.median(ts), 2), "min": round(1e3 * min(ts), 2),
                                 "max": round(1e3 * max(ts), 2), "all": [round(1e3 * t, 2) for t in ts]}
        for name in SAMPLERS:
            row[f"time_ratio_{name}_over_sorted"] = round(row[f"{name}_ms"]["median"] / row["sorted_ms"]["median"], 2)
        row["load_average_after"] = load_average()
        doc["results"].append(row)
        print(f"N={n} (logits {row['logits_mib']} MiB; load {row['load_average_before']} -> "
              f"{row['load_average_after']}): " + " | ".join(
                  f"{name} {row[f'{name}_ms']['median']} ms, alloc peak {row[f'{name}_alloc_peak_mib']} MiB, "
                  f"RSS +{row[f'{name}_rss_growth_mib']:.1f} MiB" for name in SAMPLERS), flush=True)
    doc["machine"]["load_average_end"] = load_average()
    print("wrote", write_json(ROOT / args.json if not Path(args.json).is_absolute() else args.json, doc))


if __name__ == "__main__":
    main()
