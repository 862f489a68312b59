"""Request outcomes against a real `unmask serve` with a tiny capacity (2 running + 1 queued).

- Every request lands in exactly one outcome in /metrics: completed (`e2e_request_latency_seconds_count`), an
  error by status (`request_errors_total`) or a cancellation (`request_cancellations_total`).
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from test_server import CHAT, Server, make_text_checkpoint, wait_for

CAPACITY = 3   # --max-num-seqs 2 --max-queue 1
LONG = {"messages": CHAT, "max_tokens": 3000, "stream": True}   # runs until its client goes away


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    model = make_text_checkpoint(root / "tiny-sdar")
    s = Server(model, root / "server.log", "--max-num-seqs", "2", "--max-queue", "1")
    yield s.wait_ready()
    s.stop()


def outcomes(server: Server) -> dict[str, float]:
    m = server.metrics()
    return {"completed": m.get("unmask:e2e_request_latency_seconds_count", 0.0),
            "errors": m.get("unmask:request_errors_total", 0.0),
            "cancelled": m.get("unmask:request_cancellations_total", 0.0),
            "429": errors_by_status(server).get("429", 0.0)}


def errors_by_status(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("unmask:request_errors_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('status="')[1].split('"')[0]] = float(value)
    return out


def idle(server: Server) -> bool:
    m = server.metrics()
    return m["unmask:num_requests_running"] == 0 and m["unmask:num_requests_waiting"] == 0


def first_data_line(lines) -> dict:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("the stream ended without a data line")


class Holders:
    """`k` long streams, admitted (each has sent its first chunk), closed on exit."""

    def __init__(self, server: Server, k: int):
        self.http = httpx.Client(base_url=server.url, timeout=60)
        self.streams = []
        for _ in range(k):
            r = self.http.send(self.http.build_request("POST", "/v1/chat/completions", json=LONG), stream=True)
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()   # kept: dropping the iterator would close the stream
            assert first_data_line(lines)["choices"][0]["delta"]["role"] == "assistant"
            self.streams.append((r, lines))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for r, _ in self.streams:
            r.close()
        self.http.close()


def test_every_request_lands_in_exactly_one_outcome(server):
    """A scripted mix: completions (plain and streamed), 429s (plain and streamed), disconnects mid-stream
    (running, queued, right after the first chunk, in waves that reuse the freed slots as the issue's client
    did) and a plain request abandoned while it runs. The counters must match what the client saw."""
    assert wait_for(lambda: idle(server))
    before = outcomes(server)
    sent = {"completed": 0, "429": 0, "cancelled": 0}
    http = httpx.Client(base_url=server.url, timeout=60)

    for stream in (False, True, False, True, False):   # completed
        body = {"messages": CHAT, "max_tokens": 4, "stream": stream}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            text = r.read().decode()
        assert "[DONE]" in text if stream else json.loads(text)["choices"][0]["finish_reason"] == "length"
        sent["completed"] += 1

    with Holders(server, CAPACITY):                     # 429s while full; the holders are then cancelled
        for stream in (False, True, True, False):
            with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": stream}) as r:
                assert r.status_code == 429 and r.headers["retry-after"]
            sent["429"] += 1
    sent["cancelled"] += CAPACITY

    async def wave_client(aclient: httpx.AsyncClient, seen: list):
        for _ in range(8):
            async with aclient.stream("POST", "/v1/chat/completions", json=LONG) as r:
                if r.status_code == 200:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break   # gone after the first chunk
                seen.append(r.status_code)

    async def waves():
        seen: list[int] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as aclient:
            await asyncio.gather(*(wave_client(aclient, seen) for _ in range(CAPACITY)))
        return seen

    seen = asyncio.run(waves())
    assert len(seen) == 8 * CAPACITY and set(seen) <= {200, 429}
    sent["cancelled"] += seen.count(200)
    sent["429"] += seen.count(429)   # a wave may arrive before the server has seen its predecessor leave

    with pytest.raises(httpx.ReadTimeout):              # a plain request abandoned while it runs
        http.post("/v1/chat/completions", json={**LONG, "stream": False}, timeout=httpx.Timeout(60, read=1.0))
    sent["cancelled"] += 1
    http.close()

    total = sum(sent.values())

    def counted() -> dict[str, float]:
        after = outcomes(server)
        return {k: after[k] - before[k] for k in after}

    assert wait_for(lambda: idle(server) and sum(counted()[k] for k in ("completed", "errors", "cancelled")) >= total)
    got = counted()
    assert got == {"completed": sent["completed"], "429": sent["429"], "cancelled": sent["cancelled"],
                   "errors": sent["429"]}, (got, sent)

