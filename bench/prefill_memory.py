"""Peak memory of a long prefill against issue 34's goal (weights + KV cache + 1 GB), and the up-front refusal of a
prompt that cannot fit.

One child process per KV cache dtype, so each has its own high-water mark. A child loads the model (the context
limit raised to the prompt, as bench/prefill_cost.py does), builds the engine and reads its RSS; asks the engine to
admit a prompt past what its memory check allows (it must raise MemoryLimitError naming the tokens that would fit,
before allocating anything: the RSS is read again); then prefills a LENGTH-token prompt of held-out text in
max_batch_tokens chunks up to the first answer token and reads the peak RSS (VmHWM: the most the process ever held,
the Python runtime, torch and the tokenizer included). Reported against weights + the request's KV cache (the
allocated cache of prompt + max_tokens) + 1 GiB.

    nice -n 19 .venv/bin/python bench/prefill_memory.py --length 131072 --kv-cache-dtypes bfloat16,int8 \
        --json docs/bench/prefill-cost/memory-128k.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

from benchlib.common import PeakMemory, write_json  # noqa: E402

MIB = 2**20
_status_kb = PeakMemory._status  # a /proc/self/status field in kB (VmRSS, VmHWM)


def child(args) -> dict:
    import torch

    from benchlib.cost import corpus_ids
    from prefill_cost import load
    from unmask.engine import memory
    from unmask.engine.engine import Engine
    from unmask.engine.params import GenerationParams
    from unmask.errors import MemoryLimitError
    from unmask.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    kv_dtype = memory.resolve_kv_cache_dtype(args.kv_cache_dtype)
    model, spec = load(args.model, args.dtype, args.length + 64)
    ids = corpus_ids(Tokenizer(args.model), args.corpus, args.length)

    def engine():
        return Engine(model, spec, None, max_num_seqs=1, max_batch_tokens=args.chunk, prefix_cache_bytes=0,
                      kv_cache_dtype=kv_dtype)

    eng = engine()
    params = GenerationParams(max_tokens=spec.block_size, ignore_eos=True, policy="topk", tokens_per_step=1)
    weights = {id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    out = {"kv_cache_dtype": args.kv_cache_dtype, "weights_dtype": str(model.lm_head.weight.dtype),
           "weights_mb": sum(weights.values()) / MIB, "threads": args.threads, "chunk": args.chunk,
           "engine_bytes_per_token": eng.memory_per_token, "kv_bytes_per_token": eng.kv_bytes_per_token,
           "rss_loaded_mb": _status_kb("VmRSS") / 1024}

    # refused up front: a prompt 10% past what the check allows now (memory moves while other processes run)
    room = memory.budget(eng.memory_per_token, "cpu")
    eng.traits = dataclasses.replace(eng.traits, max_context=2 * room.tokens + 2 * args.length)
    too_long = [ids[0]] * int(room.tokens * 1.1)
    rss0 = _status_kb("VmRSS")
    try:
        eng.add_request(too_long, params)
        out["refusal"] = {"refused": False, "prompt_tokens": len(too_long)}
    except MemoryLimitError as e:
        out["refusal"] = {"refused": True, "prompt_tokens": len(too_long), "budget_tokens": room.tokens,
                          "message": str(e), "rss_growth_mb": (_status_kb("VmRSS") - rss0) / 1024}
    del too_long
    eng = engine()  # a fresh engine with nothing queued (were the prompt admitted, it would wait in this one)
    print(f"[{args.kv_cache_dtype}] refusal: {out['refusal']}", flush=True)

    with open("/proc/self/clear_refs", "w") as fh:  # the high-water mark from here (the list above is gone)
        fh.write("5")
    out["rss_before_request_mb"] = _status_kb("VmRSS") / 1024
    with torch.no_grad():
        t0 = time.perf_counter()
        seq = eng.add_request(ids, params)
        while seq.num_generated == 0:
            eng.step()
        out["ttft_s"] = time.perf_counter() - t0
    out["prompt_tokens"] = len(ids)
    out["kv_cache_mb"] = seq.cache.nbytes() / MIB
    out["peak_rss_mb"] = _status_kb("VmHWM") / 1024
    out["goal_mb"] = out["weights_mb"] + out["kv_cache_mb"] + 1024
    out["within_goal"] = out["peak_rss_mb"] <= out["goal_mb"]
    out["peak_over_before_mb"] = out["peak_rss_mb"] - out["rss_before_request_mb"]
    out["load_after"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "bench/models/unmask-tiny-5m"))
    ap.add_argument("--corpus", default=str(ROOT / "data/corpus/heldout.jsonl"))
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--dtype", default="float32", help="weights (the 5.25M model's own dtype)")
    ap.add_argument("--kv-cache-dtypes", default="bfloat16,int8")
    ap.add_argument("--kv-cache-dtype", default=None, help=argparse.SUPPRESS)  # set in a child
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=4096, help="max_batch_tokens: the prefill chunk (engine default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.kv_cache_dtype:  # a child: one measurement, one JSON line last
        print(json.dumps(child(args)), flush=True)
        return
    rows = []
    for dtype in args.kv_cache_dtypes.split(","):
        cmd = [sys.executable, __file__, "--model", args.model, "--corpus", args.corpus, "--length", str(args.length),
               "--dtype", args.dtype, "--threads", str(args.threads), "--chunk", str(args.chunk),
               "--kv-cache-dtype", dtype]
        load = os.getloadavg()
        run = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(run.stderr[-2000:])
        if run.returncode:
            raise SystemExit(f"{dtype}: the child failed ({run.returncode})")
        print(run.stdout.rsplit("\n", 2)[0], flush=True)
        row = {**json.loads(run.stdout.strip().splitlines()[-1]), "load_before": load}
        rows.append(row)
        print(f"{args.length} tokens, {dtype} cache under {row['weights_dtype']} weights: peak RSS "
              f"{row['peak_rss_mb']:.0f} MB (before the request {row['rss_before_request_mb']:.0f} MB) against "
              f"weights {row['weights_mb']:.0f} + KV {row['kv_cache_mb']:.0f} + 1024 = {row['goal_mb']:.0f} MB: "
              f"{'within' if row['within_goal'] else 'OVER'}; TTFT {row['ttft_s']:.0f} s; refused up front: "
              f"{row['refusal']['refused']}", flush=True)
    if args.json:
        write_json(args.json, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
