"""`unmask loadtest --burst N`: N requests written at once, for the overload case (a server that must answer most of
them 429 quickly while it serves the rest).

An HTTP client library spends its own CPU time on each request, and in a burst of hundreds that work queues up in
one process: on this project's loaded 2-core VM, 500 httpx requests at `--rate inf` saw their 429s 14-23 s after
sending, where the server had answered within 0.4 s (docs/loadtest.md). So a burst opens every connection first,
untimed, builds every request's bytes first, then writes them all and times each to its status line on raw
sockets, as `bench/serve_load.py --burst` always did (it now uses this module). A 200 is read to its end; every
answer is checked: 429s for `Retry-After` and an OpenAI error envelope, streams for `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time

import httpx

from unmask.loadtest.client import Target
from unmask.loadtest.metrics import percentile
from unmask.loadtest.workloads import Prompt


def request_bytes(target: Target, prompt: Prompt, max_tokens: int) -> bytes:
    """One HTTP/1.1 request of the burst, whole (Connection: close: the answer ends with the connection)."""
    url = httpx.URL(target.url)
    body = json.dumps(target.body(prompt, max_tokens)).encode()
    headers = {"Host": url.netloc.decode(), "Content-Type": "application/json", "Connection": "close",
               "Content-Length": str(len(body)), **target.headers()}
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"POST {url.path.rstrip('/')}{target.path} HTTP/1.1\r\n{head}\r\n".encode("latin-1") + body


async def burst_request(host: str, port: int, payload: bytes, go: asyncio.Event,
                        tls: ssl.SSLContext | None = None) -> dict:
    """One request of a burst on its own connection, opened before `go`: status, seconds from writing the request
    to reading the status line, headers (lower-case names), body."""
    reader, writer = await asyncio.open_connection(host, port, ssl=tls)
    try:
        await go.wait()
        t0 = time.perf_counter()
        writer.write(payload)
        status_line = await reader.readline()
        latency = time.perf_counter() - t0
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        headers = dict((k.strip().lower(), v.strip()) for k, _, v in
                       (line.partition(":") for line in head.split("\r\n") if line))
        body = await reader.read() if "content-length" not in headers else \
            await reader.readexactly(int(headers["content-length"]))
        return {"status": int(status_line.split()[1]), "latency": latency, "headers": headers, "body": body}
    finally:
        writer.close()


def _is_envelope(body: bytes) -> bool:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str)


def _complete(body: bytes, stream: bool) -> bool:
    if stream:  # a chunked stream: its last event is data: [DONE]
        return b"data: [DONE]" in body
    return b'"choices"' in body


def _ms(xs: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": (None if (p := percentile(xs, q)) is None else 1e3 * p)
                                    for q in (50, 90, 99)}
    out["max"] = 1e3 * max(xs) if xs else None
    return out


async def run_burst(target: Target, work: list[tuple[Prompt, int]], settle_s: float = 0.5) -> dict:
    """Writes len(work) requests to `target` at once (connections opened first, then `settle_s` for the server to
    accept them all); the answers by status, their checks, and the latency to each status line."""
    url = httpx.URL(target.url)
    tls = ssl.create_default_context() if url.scheme == "https" else None
    port = url.port or (443 if tls else 80)
    payloads = [request_bytes(target, p, n) for p, n in work]
    go = asyncio.Event()
    tasks = [asyncio.create_task(burst_request(url.host, port, b, go, tls)) for b in payloads]
    await asyncio.sleep(settle_s)
    t0 = time.perf_counter()
    go.set()
    got = await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.perf_counter() - t0
    answers = [g for g in got if isinstance(g, dict)]
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a["status"])] = statuses.get(str(a["status"]), 0) + 1
    busy = [a for a in answers if a["status"] == 429]
    ok = [a for a in answers if a["status"] == 200]
    return {
        "burst": len(work), "statuses": dict(sorted(statuses.items())), "connection_errors": len(got) - len(answers),
        "wall_s": wall, "429_with_retry_after": sum("retry-after" in a["headers"] for a in busy),
        "429_envelopes": sum(_is_envelope(a["body"]) for a in busy),
        "200_complete": sum(_complete(a["body"], target.stream) for a in ok),
        "429_status_ms": _ms([a["latency"] for a in busy]), "200_status_ms": _ms([a["latency"] for a in ok]),
    }
