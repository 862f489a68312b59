"""Needle in a haystack: accuracy by depth x length, as a JSON table and a heat-map PNG (issue 34).

The task and scoring are the library's (`unmask.evaluation_needle`; `unmask eval --needle` runs the same): a
`PASSKEY = "NNNNN"` line at each depth of the held-out corpus files, at each prompt length, answered greedily
and scored by exact match of the value. `--smoke` instead runs the public families' tiny random checkpoints
(tests/tiny_checkpoints.py) at small lengths: a check that every family runs the task, not a measurement.

    nice -n 19 .venv/bin/python bench/needle.py --lengths 1024,4096 --trials 4 --out docs/bench/needle
    .venv/bin/python bench/needle.py --smoke --out build/needle-smoke

Writes OUT/needle.json (one entry per model) and OUT/needle[-FAMILY].png; prints the tables, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from benchlib.common import write_json  # noqa: E402


def heatmap(entry: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = entry["results"]
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = np.full((len(depths), len(lengths)), np.nan)
    for c in cells:
        if c["refused"] < c["n"]:
            acc[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
    fig, ax = plt.subplots(figsize=(1.4 + 1.1 * len(lengths), 1.2 + 0.55 * len(depths)))
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, "refused" if np.isnan(acc[i, j]) else f"{acc[i, j]:.0%}", ha="center", va="center",
                    fontsize=8)
    past = {c["length"] for c in cells if c["past_context"]}
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K{'*' if n in past else ''}" if n % 1024 == 0 else
                                        f"{n}{'*' if n in past else ''}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("prompt tokens (* past the configured context)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{Path(entry['model']).name}: needle accuracy ({entry['trials']} per cell)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(model, docs, lengths, depths, trials: int, policy: str, dtype: str | None, seed: int = 0) -> dict:
    from unmask.engine.llm import LLM
    from unmask.evaluation_needle import report

    t0 = time.perf_counter()
    entry = report(LLM(model, dtype=dtype), docs, lengths, depths, trials, policy, seed,
                   log=lambda line: print(line, file=sys.stderr, flush=True))
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Model directory (default: the built-in model).")
    ap.add_argument("--corpus", default="data/corpus/heldout.jsonl")
    ap.add_argument("--lengths", default="1024,4096,16384,65536,131072")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0,
                    help="draws the values and haystack offsets: another seed asks new prompts of the same cells")
    ap.add_argument("--policy", default="threshold_0.9", help="an eval policy, or default (the model's own)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--smoke", action="store_true", help="The public families' tiny checkpoints at --smoke-lengths.")
    ap.add_argument("--smoke-lengths", default="256,1024")
    ap.add_argument("--out", default="build/needle")
    args = ap.parse_args()

    import torch

    from unmask.train.corpus import read_documents

    if args.threads:
        torch.set_num_threads(args.threads)
    docs = list(read_documents(Path(args.corpus)))
    depths = [float(d) for d in args.depths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entries = {}
    if args.smoke:
        from tiny_checkpoints import FAMILIES

        os.environ.setdefault("UNMASK_DTYPE", "float32")
        lengths = [int(n) for n in args.smoke_lengths.split(",")]
        with tempfile.TemporaryDirectory() as tmp:
            for name, make in FAMILIES.items():
                entries[name] = measure(make(Path(tmp) / name), docs, lengths, depths, 1, args.policy, args.dtype)
    else:
        lengths = [int(n) for n in args.lengths.split(",")]
        name = Path(args.model).name if args.model else "unmask-tiny"
        entries[name] = measure(args.model, docs, lengths, depths, args.trials, args.policy, args.dtype, args.seed)
    for name, entry in entries.items():
        print(f"{name} ({entry['policy']}, {entry['trials']} per cell, {entry['seconds']} s):\n{entry['table']}\n")
        heatmap(entry, out / (f"needle-{name}.png" if args.smoke else "needle.png"))
    meta = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(),
            "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    write_json(out / "needle.json", {**meta, "models": entries}, indent=2)
    print(json.dumps({name: {f"{c['length']}@{c['depth']}": c["accuracy"] for c in e["results"]}
                      for name, e in entries.items()}))


if __name__ == "__main__":
    main()
