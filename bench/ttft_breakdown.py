"""Where a client's time to first token goes, stage by stage, on one `unmask serve` (docs/loadtest.md).

    python bench/ttft_breakdown.py --requests 40 --concurrency 1,4,16 [--json out.json]

Starts `unmask serve` in a child process whose HTTP layer and serving layer also log, per request (tagged by an
x-breakdown-id header the client adds), the moments its bytes reached the server's event loop (uvicorn's parser
begins the message), the application started on it, the admission gate's arrival (where the server's histograms
start), its handler, its first committed token, its first chunk with text handed to the HTTP layer and that
chunk's write to the socket. The client is the load tester's own (unmask.loadtest.client.send) in a closed loop of
`concurrency` streams; its records hold the moments the request started to be written and the first chunk's bytes
were read. time.perf_counter() is CLOCK_MONOTONIC on Linux: one clock for both processes. Stages, mean and median:

    client: before writing        the client's clock start to the request's first byte written (httpx builds the
                                  request, the connection pool; the client's event loop busy with other streams)
    loopback + server wake-up     to uvicorn's parser seeing it (kernel, the server's event loop, the GIL)
    server: parse + app start     headers parsed, the request task started, the CORS / key middleware
    gate (arrival)                the admission gate takes its slot and starts the server's clock
    arrival -> handler            the admission gate's settle wait (SETTLE_S), the body read, validation
    handler -> first token        chat template, tokenisation, the engine's queue, prefill and steps
    first token -> first chunk    stream framing (stop-string hold-back, the chunk's JSON)
    first chunk -> socket         the chunk through the ASGI send chain to uvicorn's transport.write
    socket -> client read         loopback, the client's event loop, httpx reading the bytes
    client: SSE + JSON            splitting the SSE lines and parsing the chunk's JSON

and the client's TTFT (vLLM's) and wire TTFT (its first byte written to the first chunk's read) against the
server's `unmask:time_to_first_chunk_seconds` (arrival -> first chunk).
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchlib.common import write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# run in the child: the server with its HTTP parser, admission gate, chat handler and TTFT histograms wrapped to log
# their moments (one JSON line each, tagged with the request's x-breakdown-id)
CHILD = r"""
import contextvars, json, sys, time
from uvicorn.protocols.http import httptools_impl, h11_impl
from unmask.server import admission, metrics as M, serving
log = open(sys.argv.pop(1), "a", buffering=1)
rid = contextvars.ContextVar("breakdown_id", default=None)
sent_state = contextvars.ContextVar("breakdown_state", default=None)
def emit(ev, t, **kw):
    if rid.get() is not None:
        log.write(json.dumps({"id": rid.get(), "ev": ev, "t": t, **kw}) + "\n")
for proto in (httptools_impl.HttpToolsProtocol, h11_impl.H11Protocol):
    def begin(self, _o=getattr(proto, "on_message_begin", None)):
        t = time.perf_counter()
        _o(self)
        self.scope["breakdown_recv"] = t
    if hasattr(proto, "on_message_begin"):
        proto.on_message_begin = begin
gate = admission.AdmissionGate.__call__
async def gated(self, scope, receive, send):
    t = time.perf_counter()
    ids = [v for k, v in scope.get("headers", ()) if k == b"x-breakdown-id"]
    if not ids:
        return await gate(self, scope, receive, send)
    rid.set(ids[0].decode())
    emit("recv", scope.get("breakdown_recv", t))
    emit("app", t)
    state = {"ttfc": False, "written": False}
    async def sending(message):
        if state["ttfc"] and not state["written"] and message.get("type") == "http.response.body":
            state["written"] = True
            await send(message)
            emit("written", time.perf_counter())
            return
        await send(message)
    sent_state.set(state)
    return await gate(self, scope, receive, sending)
admission.AdmissionGate.__call__ = gated
chat = serving.OpenAIServing.chat
async def logged(self, req, is_disconnected=None):
    emit("handler", time.perf_counter(), arrival=M.arrival())
    return await chat(self, req, is_disconnected)
serving.OpenAIServing.chat = logged
init = M.Metrics.__init__
def wrapped(self):
    init(self)
    for name in ("ttft", "ttfc"):
        hist = getattr(self, name)
        def observe(v, o=hist.observe, name=name):
            emit(name, time.perf_counter())
            if name == "ttfc" and sent_state.get() is not None:
                sent_state.get()["ttfc"] = True
            o(v)
        hist.observe = observe
M.Metrics.__init__ = wrapped
from unmask.cli import main
sys.argv[0] = "unmask"
main()
"""
STAGES = ("client: before writing", "loopback + server wake-up", "server: parse + app start", "gate (arrival)",
          "arrival -> handler", "handler -> first token", "first token -> first chunk", "first chunk -> socket",
          "socket -> client read", "client: SSE + JSON")

_current: contextvars.ContextVar[dict] = contextvars.ContextVar("breakdown_request")


async def _tag(request: httpx.Request) -> None:
    """httpx request hook (the request is built, about to be sent): tags it for the server's log."""
    request.headers["x-breakdown-id"] = _current.get()["id"]


async def client(url: str, n: int, warmup: int, concurrency: int, input_len: int, output_len: int) -> list[dict]:
    from unmask.loadtest.client import Target, send
    from unmask.loadtest.workloads import parse_length, random_prompts

    target = Target("A", url, "unmask-tiny", ignore_eos=True)
    prompts = random_prompts(n + warmup, parse_length(str(input_len), "-"), parse_length(str(output_len), "-"), 0)
    todo = iter(enumerate(prompts))
    out = []

    async def one_stream(http):
        for i, p in todo:
            mine = {"id": f"{concurrency}-{i}"}
            _current.set(mine)
            rec = await send(http, target, p, output_len)
            assert rec.ok and rec.ttft is not None, rec.detail
            if i >= warmup:
                out.append({**mine, "start": rec.start, "sent": rec.sent, "read": rec.first_read,
                            "received": rec.start + rec.ttft})

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits, event_hooks={"request": [_tag]}) as http:
        for i, p in enumerate(prompts[:warmup]):   # unmeasured, one at a time
            _current.set({"id": f"w-{concurrency}-{i}"})
            await send(http, target, p, output_len)
        todo = iter(list(enumerate(prompts))[warmup:])
        await asyncio.gather(*(one_stream(http) for _ in range(concurrency)))
    return out


def stages(sent: list[dict], server: dict[str, dict]) -> list[dict]:
    rows = []
    for c in sent:
        s = server[c["id"]]
        moments = (c["start"], c["sent"], s["recv"], s["app"], s["arrival"], s["handler"], s["ttft"], s["ttfc"],
                   s["written"], c["read"], c["received"])
        rows.append({**{k: b - a for k, a, b in zip(STAGES, moments, moments[1:])},
                     "client TTFT": c["received"] - c["start"], "client wire TTFT": c["read"] - c["sent"],
                     "server time to first chunk": s["ttfc"] - s["arrival"]})
    return rows


def summary(rows: list[dict]) -> dict:
    return {k: {"mean_ms": 1e3 * statistics.mean(r[k] for r in rows),
                "median_ms": 1e3 * statistics.median(r[k] for r in rows)} for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="measured requests per concurrency level")
    ap.add_argument("--concurrency", default="1", help="closed-loop streams, comma-separated levels")
    ap.add_argument("--repeats", type=int, default=1, help="run the levels this many times, interleaved")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--port", type=int, default=18790)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    log = Path(tempfile.mkdtemp()) / "server.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen([sys.executable, "-c", CHILD, str(log), "serve", "--port", str(args.port),
                               "--max-num-seqs", str(max(64, max(levels))), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{args.port}"
    runs = []
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
        for rep in range(args.repeats):
            for c in levels:
                sent = asyncio.run(client(url, args.requests, args.warmup, c, args.input_len, args.output_len))
                runs.append({"repeat": rep, "concurrency": c, "sent": sent, "loadavg_1min": os.getloadavg()[0]})
    finally:
        server.terminate()
        server.wait(30)
    by_id: dict[str, dict] = {}
    for line in log.read_text().splitlines():
        e = json.loads(line)
        moments = by_id.setdefault(e["id"], {})
        moments.setdefault(e["ev"], e["t"])
        if "arrival" in e:
            moments["arrival"] = e["arrival"]
    results = []
    for run in runs:
        table = summary(stages(run["sent"], by_id))
        ratio = table["client TTFT"]["mean_ms"] / table["server time to first chunk"]["mean_ms"]
        wire = table["client wire TTFT"]["mean_ms"] / table["server time to first chunk"]["mean_ms"]
        print(f"\nconcurrency {run['concurrency']}, repeat {run['repeat']}: {len(run['sent'])} requests, "
              f"load average {run['loadavg_1min']:.1f}")
        for k, v in table.items():
            print(f"  {k:36s} mean {v['mean_ms']:8.2f} ms   median {v['median_ms']:8.2f} ms")
        print(f"  client TTFT / server time to first chunk (means): {ratio:.3f}; wire TTFT / it: {wire:.3f}")
        results.append({"concurrency": run["concurrency"], "repeat": run["repeat"], "requests": len(run["sent"]),
                        "stages": table, "ratio_of_means": ratio, "wire_ratio_of_means": wire, "loadavg_1min": run["loadavg_1min"]})
    if args.json:
        write_json(args.json, {"runs": results, "args": vars(args) | {"json": None}})


if __name__ == "__main__":
    main()
