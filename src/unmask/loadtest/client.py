"""One request over HTTP and its timing record, and the two schedules that send many: a closed loop of
`concurrency` clients, or Poisson arrivals at `rate` requests/s (optionally capped at `max_concurrency`).

Times are time.perf_counter() seconds. Streaming: TTFT is the arrival of the first chunk that carries
generated text (or a tool-call / reasoning delta), ITL the gaps between such chunks; a chunk that carries a
whole block of a diffusion model counts once, as vLLM counts a chunk. Failures are records too, with a kind:
`http <status>`, `timeout`, `connection` or `malformed stream`.

Besides vLLM's clock (from before the request is built to the first chunk parsed), each record keeps the moments
its request started to be written to the socket (httpcore's trace) and the bytes of its first chunk with text came
out of the HTTP library (before SSE and JSON parsing): the wire TTFT between them is the interval a server can
time, and the rest is this client's own work (docs/loadtest.md, "Against the server's own /metrics")."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import httpx

from unmask.loadtest.workloads import Prompt


@dataclass
class Target:
    name: str  # "A" / "B" in a --compare run
    url: str   # base URL, without /v1
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "chat"  # "chat" | "completions"
    stream: bool = True
    extra_body: dict = field(default_factory=dict)
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout: float = 600.0  # seconds for the whole request, streamed or not

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: Prompt, max_tokens: int) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
                      "stream": self.stream}
        if self.endpoint == "chat":
            body["messages"] = prompt.as_messages()
        else:
            body["prompt"] = prompt.as_text()
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **self.extra_body}


@dataclass
class Record:
    """One request as the client saw it. ok=False records keep their place in every denominator."""
    start: float
    e2e: float = 0.0
    ok: bool = False
    error: str | None = None      # failure kind: "http 401", "timeout", "connection", "malformed stream"
    detail: str = ""
    retry_after: bool = False     # an HTTP error answer carried Retry-After (a 429's or 503's promise)
    ttft: float | None = None     # streaming only
    sent: float | None = None     # when the request's headers started to be written (None: never written)
    first_read: float | None = None   # when the bytes holding the first chunk with text were read (streaming)
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None      # from the server's usage
    output_tokens: int | None = None      # from the server's usage, else a local tokenizer's count, else None
    usage: bool = False                   # the server sent usage with completion_tokens
    text: str = ""
    prompt: Prompt | None = None


class Malformed(Exception):
    pass


def _delta_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    d = choice.get("delta") or {}
    text = (d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "")
    if d.get("tool_calls"):
        text += json.dumps(d["tool_calls"])
    return text


def _message_text(choice: dict, chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    m = choice.get("message") or {}
    return (m.get("content") or "") + (m.get("reasoning_content") or "") + \
        (json.dumps(m["tool_calls"]) if m.get("tool_calls") else "")


def _usage(rec: Record, usage: object) -> None:
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.output_tokens = usage["completion_tokens"]
        rec.usage = True


async def _sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[float, str]]:
    """(read time, line) for each line of an SSE byte stream, the time being when the bytes that end the line came
    out of the HTTP library; lines end at \n, a trailing \r is dropped (what SSE servers send)."""
    buf = b""
    async for data in chunks:
        now = time.perf_counter()
        *complete, buf = (buf + data).split(b"\n")
        for line in complete:
            yield now, line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buf:
        yield time.perf_counter(), buf.rstrip(b"\r").decode("utf-8", errors="replace")


async def send(http: httpx.AsyncClient, target: Target, prompt: Prompt, max_tokens: int) -> Record:
    rec = Record(start=time.perf_counter(), prompt=prompt)
    try:
        async with asyncio.timeout(target.timeout):
            await _exchange(http, target, prompt, max_tokens, rec)
    except (httpx.TimeoutException, TimeoutError) as e:
        rec.error, rec.detail = "timeout", type(e).__name__
    except (httpx.TransportError, OSError) as e:  # refused, reset, closed mid-body
        rec.error, rec.detail = "connection", f"{type(e).__name__}: {e}"[:200]
    except Malformed as e:
        rec.error, rec.detail = "malformed stream" if target.stream else "malformed response", str(e)
    finally:
        rec.e2e = time.perf_counter() - rec.start
    return rec


async def _exchange(http: httpx.AsyncClient, target: Target, prompt: Prompt, max_tokens: int, rec: Record) -> None:
    """Send one request and fill `rec` as it answers; raises on transport errors and malformed answers."""
    chat = target.endpoint == "chat"
    body = target.body(prompt, max_tokens)

    async def trace(event: str, info: dict) -> None:   # httpcore calls it around each stage of the exchange
        if event == "http11.send_request_headers.started" and rec.sent is None:
            rec.sent = time.perf_counter()

    ext = {"trace": trace}
    if not target.stream:
        r = await http.post(target.url + target.path, json=body, headers=target.headers(), extensions=ext)
        if r.status_code != 200:
            rec.error, rec.detail, rec.retry_after = f"http {r.status_code}", r.text[:200], "retry-after" in r.headers
            return
        try:
            data = r.json()
            rec.text = "".join(_message_text(c, chat) for c in data["choices"])
        except (ValueError, KeyError, TypeError) as e:
            raise Malformed(f"response is not a completion: {e}") from None
        _usage(rec, data.get("usage"))
        rec.ok = True
        return
    async with http.stream("POST", target.url + target.path, json=body, headers=target.headers(),
                           extensions=ext) as r:
        if r.status_code != 200:
            rec.error, rec.detail = f"http {r.status_code}", (await r.aread()).decode(errors="replace")[:200]
            rec.retry_after = "retry-after" in r.headers
            return
        async with aclosing(_sse_lines(r.aiter_bytes())) as lines:
            await _read_stream(lines, rec, chat)


async def _read_stream(lines: AsyncIterator[tuple[float, str]], rec: Record, chat: bool) -> None:
    """Fill `rec` from a streamed answer's SSE lines; raises Malformed on a line that breaks the protocol."""
    last, done, pieces = None, False, []
    async for read_at, line in lines:
        if not line.strip() or line.startswith((":", "event:", "id:", "retry:")):  # comments, SSE fields
            continue
        if not line.startswith("data:"):
            raise Malformed(f"not an SSE data line: {line[:80]!r}")
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            raise Malformed(f"chunk is not JSON: {payload[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise Malformed("chunk is not a JSON object")
        if "error" in chunk:  # an error after the 200: the server gave up mid-stream
            raise Malformed(f"error event: {str(chunk['error'])[:160]}")
        _usage(rec, chunk.get("usage"))
        text = "".join(_delta_text(c, chat) for c in chunk.get("choices") or [] if isinstance(c, dict))
        if text:
            now = time.perf_counter()
            if rec.ttft is None:
                rec.ttft, rec.first_read = now - rec.start, read_at
            else:
                rec.itl.append(now - last)
            last = now
            pieces.append(text)
    if not done:
        raise Malformed("stream ended without data: [DONE]")
    rec.text = "".join(pieces)
    rec.ok = True


async def preconnect(http: httpx.AsyncClient, target: Target, n: int) -> None:
    """Open about n keep-alive connections to the target before a point is timed, as `bench/serve_load.py --burst`
    opens its sockets first: n concurrent GET /v1/models, whose connections the pool keeps for the requests."""
    await asyncio.gather(*(http.get(f"{target.url}/v1/models", headers=target.headers()) for _ in range(n)),
                         return_exceptions=True)


async def closed_loop(http: httpx.AsyncClient, target: Target, work: list[tuple[Prompt, int]], concurrency: int,
                      done: Callable[[], None] = lambda: None) -> list[Record]:
    """`concurrency` clients, each sending its next request as soon as its previous one ends."""
    todo = iter(work)
    out: list[Record] = []

    async def client():
        for prompt, max_tokens in todo:
            out.append(await send(http, target, prompt, max_tokens))
            done()

    await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
    return out


async def poisson(http: httpx.AsyncClient, target: Target, work: list[tuple[Prompt, int]], rate: float,
                  max_concurrency: int | None, seed: int, done: Callable[[], None] = lambda: None) -> list[Record]:
    """Requests start at Poisson arrivals of `rate` per second (exponential gaps; inf = all at once), as vLLM's
    `--request-rate`; with max_concurrency, an arrival waits for a free slot."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(prompt, max_tokens):
        if gate is None:
            rec = await send(http, target, prompt, max_tokens)
        else:
            async with gate:
                rec = await send(http, target, prompt, max_tokens)
        done()
        return rec

    tasks = []
    for i, (prompt, max_tokens) in enumerate(work):
        if i and rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
    return list(await asyncio.gather(*tasks))
