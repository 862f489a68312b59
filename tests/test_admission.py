"""Admission and request outcomes against a real `unmask serve` with a tiny capacity (2 running + 1 queued).

- A full server answers 429 (Retry-After, OpenAI envelope) on arrival, before it reads the body; a burst gets
  exactly as many 200s as there are slots, and every slot taken on arrival is given back, whatever the answer.
- Every request lands in exactly one outcome in /metrics: completed (`e2e_request_latency_seconds_count`), an
  error by status (`request_errors_total`) or a cancellation (`request_cancellations_total`).
"""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from test_server import CHAT, Server, assert_envelope, make_text_checkpoint, wait_for

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


def raw_request(server: Server, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send `head` (and `body`) on a fresh socket; (status, headers, body) of the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(rest) < int(headers.get("content-length", 0)):
            rest += sock.recv(65536)
        return int(lines[0].split()[1]), headers, rest


def test_a_full_server_answers_429_before_reading_the_body(server):
    with Holders(server, CAPACITY):
        # headers promise a 100 kB body that is never sent: a server that read it first would never answer
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n")
        status, headers, body = raw_request(server, head)
        assert status == 429 and int(headers["retry-after"]) >= 1
        err = json.loads(body)["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "server busy" in err["message"]
        for path in ("/v1/completions", "/v1/fim/completions", "/v1/responses", "/v1/edit/completions"):
            assert_envelope(httpx.post(f"{server.url}{path}", json={}, timeout=30), 429)
        # routes that start no generation still answer
        assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 200
        assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200
    assert wait_for(lambda: idle(server))


def test_a_burst_gets_exactly_one_200_per_slot(server):
    async def one(http: httpx.AsyncClient, answers: list, release: asyncio.Event):
        async with http.stream("POST", "/v1/chat/completions", json=LONG) as r:
            answers.append((r.status_code, r.headers.get("retry-after"), await r.aread() if r.status_code != 200
                            else b""))
            if r.status_code == 200:
                await release.wait()   # hold the slot until every answer is in

    async def burst():
        answers, release = [], asyncio.Event()
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            tasks = [asyncio.create_task(one(http, answers, release)) for _ in range(30)]
            while len(answers) < 30:
                await asyncio.sleep(0.05)
            release.set()
            await asyncio.gather(*tasks)
        return answers

    answers = asyncio.run(burst())
    assert sorted(status for status, _, _ in answers).count(200) == CAPACITY
    busy = [(retry, body) for status, retry, body in answers if status == 429]
    assert len(busy) == 30 - CAPACITY
    assert all(int(retry) >= 1 and json.loads(body)["error"]["code"] == "queue_full" for retry, body in busy)
    assert wait_for(lambda: idle(server))


def test_slots_taken_on_arrival_are_given_back_whatever_the_answer(server):
    http = httpx.Client(base_url=server.url, timeout=60)
    with Holders(server, CAPACITY - 1):
        # one slot free: n=2 takes it on arrival, then is refused for the second choice
        assert_envelope(http.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "max_tokens": 4}), 429)
        assert_envelope(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": "x"}), 400)
        assert_envelope(http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}),
                        400)
        assert_envelope(http.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT}), 404)
        assert_envelope(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**7}), 400)
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert wait_for(lambda: idle(server))
    # every slot is free again: a request needing all of them is admitted
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "n": CAPACITY, "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == CAPACITY
    http.close()


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

    # the last wave's slots are released once the server sees those clients gone: until then a new request may
    # meet a full server (a 429 at once, not the running request this step abandons)
    assert wait_for(lambda: idle(server))
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


def test_admission_counts_a_reservation_toward_the_jobs():
    from unmask.server.admission import Admission, _reservation
    from unmask.server.protocol import APIError

    a = Admission(max_num_seqs=2, max_queue=1)
    r = a.reserve()
    token = _reservation.set(r)
    try:
        a.acquire(1)                  # the reserved slot becomes the job's
        assert a.inflight == 1 and r.held == 0
    finally:
        _reservation.reset(token)
    r.release()                       # nothing left to give back
    assert a.inflight == 1
    r = a.reserve()
    token = _reservation.set(r)
    try:
        with pytest.raises(APIError) as busy:
            a.acquire(3)              # 1 reserved + 2 more > 1 free
        assert busy.value.status == 429 and a.inflight == 2
        a.acquire(2)                  # 1 reserved + 1 more
        assert a.inflight == 3 and r.held == 0
        with pytest.raises(APIError):
            a.reserve()
    finally:
        _reservation.reset(token)
    a.release(1)
    a.release(2)
    assert a.inflight == 0

