"""Where a client's time to first token goes, stage by stage, on one `unmask serve` (docs/loadtest.md).

    python bench/ttft_breakdown.py --requests 40 [--json out.json]

Starts `unmask serve` in a child process whose serving layer also logs, per request, the moments it reached the
admission gate (`arrival`), its handler, its first committed token and its first chunk with text, then sends
sequential streamed chat requests with the load tester's own client (unmask.loadtest.client.send) and lines the
two up: time.perf_counter() is CLOCK_MONOTONIC on Linux, one clock for both processes. Prints, mean and median:

    send -> arrival               the client building and writing the request, loopback, uvicorn reading it
    arrival -> handler            the admission gate's settle wait (SETTLE_S), the body read, validation
    handler -> first token        chat template, tokenisation, the engine's queue, prefill and steps
    first token -> first chunk    stream framing (stop-string hold-back, the chunk's JSON)
    first chunk -> client         writing it, loopback, the client reading and parsing it

and the client's TTFT against the server's `unmask:time_to_first_chunk_seconds` (arrival -> first chunk).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# run in the child: the server with its serving methods wrapped to log their moments (one JSON line each)
CHILD = r"""
import json, sys, time
from unmask.server import metrics as M, serving
log = open(sys.argv.pop(1), "a", buffering=1)
chat = serving.OpenAIServing.chat
async def logged(self, req, is_disconnected=None):
    log.write(json.dumps({"ev": "handler", "t": time.perf_counter(), "arrival": M.arrival()}) + "\n")
    return await chat(self, req, is_disconnected)
serving.OpenAIServing.chat = logged
init = M.Metrics.__init__
def wrapped(self):
    init(self)
    for name in ("ttft", "ttfc"):
        hist = getattr(self, name)
        def observe(v, o=hist.observe, name=name):
            log.write(json.dumps({"ev": name, "t": time.perf_counter()}) + "\n")
            o(v)
        hist.observe = observe
M.Metrics.__init__ = wrapped
from unmask.cli import main
sys.argv[0] = "unmask"
main()
"""
STAGES = ("send -> arrival", "arrival -> handler", "handler -> first token", "first token -> first chunk",
          "first chunk -> client")


async def client(url: str, n: int, warmup: int, input_len: int, output_len: int) -> list[dict]:
    from unmask.loadtest.client import Target, send
    from unmask.loadtest.workloads import parse_length, random_prompts

    target = Target("A", url, "unmask-tiny", ignore_eos=True)
    prompts = random_prompts(n + warmup, parse_length(str(input_len), "-"), parse_length(str(output_len), "-"), 0)
    out = []
    async with httpx.AsyncClient(timeout=120) as http:
        for i, p in enumerate(prompts):
            rec = await send(http, target, p, output_len)
            assert rec.ok and rec.ttft is not None, rec.detail
            if i >= warmup:
                out.append({"start": rec.start, "received": rec.start + rec.ttft})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--port", type=int, default=18790)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    log = Path(tempfile.mkdtemp()) / "server.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen([sys.executable, "-c", CHILD, str(log), "serve", "--port", str(args.port),
                               "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("error: the server did not start")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        sent = asyncio.run(client(url, args.requests, args.warmup, args.input_len, args.output_len))
    finally:
        server.terminate()
        server.wait(30)
    reqs: list[dict] = []
    for line in log.read_text().splitlines():
        e = json.loads(line)
        if e["ev"] == "handler":
            reqs.append({"arrival": e["arrival"], "handler": e["t"]})
        elif e["ev"] not in reqs[-1]:
            reqs[-1][e["ev"]] = e["t"]
    rows = []
    for c, s in zip(sent, reqs[-len(sent):]):
        moments = (c["start"], s["arrival"], s["handler"], s["ttft"], s["ttfc"], c["received"])
        rows.append({**{k: b - a for k, a, b in zip(STAGES, moments, moments[1:])},
                     "client TTFT": c["received"] - c["start"], "server time to first chunk": s["ttfc"] - s["arrival"]})
    table = {k: {"mean_ms": 1e3 * statistics.mean(r[k] for r in rows),
                 "median_ms": 1e3 * statistics.median(r[k] for r in rows)} for k in rows[0]}
    for k, v in table.items():
        print(f"{k:28s} mean {v['mean_ms']:8.2f} ms   median {v['median_ms']:8.2f} ms")
    ratio = table["client TTFT"]["mean_ms"] / table["server time to first chunk"]["mean_ms"]
    print(f"client TTFT / server time to first chunk (means): {ratio:.3f}; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"requests": len(rows), "stages": table, "ratio_of_means": ratio,
                                         "loadavg_1min": os.getloadavg()[0], "args": vars(args) | {"json": None}},
                                        indent=1))


if __name__ == "__main__":
    main()
