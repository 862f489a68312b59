"""Host time per engine step of the static step (issue 31), split by part, on any device.

    nice -n 19 .venv/bin/python bench/static_step_host.py --batches 16,64 [--no-resident] [--sticky-rows 64]

The built-in model, float32, random-token prompts of 32 tokens, 64 new tokens, topk 4, EOS ignored, blocks of 16,
one torch thread; a warm-up run of the same requests first. perf_counter around the engine's planning
(Scheduler.schedule), the static step's staging (StaticStep._stage: the rows the step did not advance itself;
StaticStep._fill before the inputs stayed on the device) and output reading (StaticStep._outputs, its one host
read included), committing (Sequence.apply) and detokenizing (TextStream.push); the rest of a step is the
forward (on the CPU; on a GPU its launch) and the engine loop. Per step and per request in the step.
--no-resident stages every row every step (the inputs the device already holds included), for an A/B in one
checkout; the share of rows the host staged is printed either way. A second table gives each part per
request per step from its median call (times its calls per step): the sums of the first one take in every
time the process lost its core on a shared machine.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

PARTS = {"plan": ("unmask.engine.scheduler", "Scheduler", "schedule"),
         "stage": ("unmask.engine.static_step", "StaticStep", ("_stage", "_fill")),
         "read": ("unmask.engine.static_step", "StaticStep", "_outputs"),
         "commit": ("unmask.engine.sequence", "Sequence", "apply"),
         "detokenize": ("unmask.engine.detokenizer", "TextStream", "push")}


def instrument(spent: collections.Counter, calls: dict[str, list[float]] | None = None) -> None:
    """perf_counter around each part: the seconds in `spent`, and each call's own seconds in `calls`."""
    import importlib

    for name, (module, cls_name, attr) in PARTS.items():
        cls = getattr(importlib.import_module(module), cls_name)
        attr = next(a for a in (attr if isinstance(attr, tuple) else (attr,)) if hasattr(cls, a))
        real = getattr(cls, attr)

        def wrapper(*a, _real=real, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                spent[_name] += dt
                if calls is not None:
                    calls.setdefault(_name, []).append(dt)

        setattr(cls, attr, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-resident", action="store_true", help="stage every row every step")
    ap.add_argument("--sticky-rows", type=int, default=None,
                    help="keep the last step's width up to this many rows (default: the engine's, 0 on the CPU)")
    args = ap.parse_args()
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams

    torch.set_num_threads(1)
    spent: collections.Counter = collections.Counter()
    calls: dict[str, list[float]] = {}
    instrument(spent, calls)
    medians = []
    params = GenerationParams(max_tokens=64, policy="topk", tokens_per_step=4, ignore_eos=True, block_size=16)
    print("| batch | ms/step | " + " | ".join(f"{p} ms (us/request)" for p in PARTS) + " | rest ms | rows staged |")
    print("|---:|---:|" + "---:|" * (len(PARTS) + 2))
    for batch in args.batches:
        llm = LLM(None, dtype="float32", device=args.device, static_step=True, kv_pool_tokens=batch * 512,
                  max_num_seqs=batch)
        static = llm.engine.runner.static
        if args.no_resident and hasattr(static, "resident"):
            static.resident = None
        if args.sticky_rows is not None:
            static.sticky_rows = args.sticky_rows
        prompts = torch.randint(100, 4000, (batch, 32), generator=torch.Generator().manual_seed(batch)).tolist()
        for _ in range(2):  # warm-up, then the measured run
            spent.clear()
            calls.clear()
            for p in prompts:
                llm.engine.add_request(p, params)
            res = getattr(static, "resident", None)
            staged0 = (res.staged, res.resident) if res is not None else None
            steps0, t0 = llm.engine.stats.steps, time.perf_counter()
            llm.engine.run_to_completion()
            wall, steps = time.perf_counter() - t0, llm.engine.stats.steps - steps0
        cells = [f"{1000 * spent[p] / steps:.2f} ({1e6 * spent[p] / steps / batch:.0f})" for p in PARTS]
        rest = 1000 * (wall - sum(spent.values())) / steps
        share = "all"
        if staged0 is not None:  # staged / (staged real rows + resident rows); padding rows staged count too
            staged, resident = res.staged - staged0[0], res.resident - staged0[1]
            share = f"{staged / max(staged + resident, 1):.0%}"
        print(f"| {batch} | {1000 * wall / steps:.1f} | " + " | ".join(cells) + f" | {rest:.1f} | {share} |",
              flush=True)
        # the median call x calls per step: robust to the process losing its core for a while on a shared machine
        medians.append(f"| {batch} | " + " | ".join(
            f"{1e6 * statistics.median(calls[p]) * len(calls[p]) / steps / batch:.0f}" for p in PARTS) + " |")
    print("\nPer request per step, us, from each part's median call (x its calls per step / batch):\n")
    print("| batch | " + " | ".join(PARTS) + " |")
    print("|---:|" + "---:|" * len(PARTS))
    print("\n".join(medians))


if __name__ == "__main__":
    main()
