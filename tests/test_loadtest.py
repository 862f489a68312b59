"""`unmask loadtest` against real `unmask serve` processes on loopback ports (the built-in model, a few
requests with small max_tokens), plus its metric definitions on hand-computed timing records.

No timing assertions: speed goals live in bench/. Counts are asserted exactly: requests, tokens equal to
the server's usage and to its own /metrics counters, failures by kind and in every denominator."""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from test_server import Server, free_port
from unmask.cli import app
from unmask.loadtest import metrics
from unmask.loadtest.client import Record, Target, send
from unmask.loadtest.workloads import Prompt, WorkloadError, jsonl_prompts, parse_length, sharegpt_prompts

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = ROOT / "src" / "unmask" / "assets" / "unmask-tiny"
AR_TWIN = ROOT / "bench" / "models" / "ar-twin"
KEY = "loadtest-key"
POINT_KEYS = {"target", "requests", "completed", "failed", "failures", "success_rate", "without_usage", "duration_s",
              "input_tokens", "output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
              "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "cost", "server_metrics", "token_check", "failure_examples",
              "agreement", "failure_latency_ms", "failures_with_retry_after", "wire_ttft_ms", "client_own_ms"}


# ------------------------------------------------------------------------------ pure metric functions
def synthetic() -> list[Record]:
    return [
        Record(start=0, ok=True, ttft=0.1, e2e=0.5, prompt_tokens=10, output_tokens=5, itl=[0.1] * 4, usage=True),
        Record(start=0, ok=True, ttft=0.2, e2e=1.2, prompt_tokens=20, output_tokens=3, itl=[0.5, 0.5], usage=True),
        Record(start=0, ok=True, ttft=0.3, e2e=0.3, prompt_tokens=5, output_tokens=1, usage=True),
        Record(start=0, ok=False, error="http 500", e2e=0.05),
    ]


def test_percentile_is_linear_between_ranks():
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5
    assert metrics.percentile([0.1, 0.2, 0.3], 90) == pytest.approx(0.28)
    assert metrics.percentile([7], 99) == 7 and metrics.percentile([], 50) is None


def test_metric_definitions_on_hand_computed_records():
    s = metrics.summarize(synthetic(), duration=2.0, slos={"ttft": 250, "tpot": 200}, dollars_per_hour=3.6)
    assert (s["requests"], s["completed"], s["failed"], s["failures"]) == (4, 3, 1, {"http 500": 1})
    assert s["success_rate"] == 0.75
    assert (s["input_tokens"], s["output_tokens"]) == (35, 9)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5 and s["total_token_throughput"] == 22
    ap = pytest.approx
    assert s["ttft_ms"] == {"mean": ap(200), "p50": ap(200), "p90": ap(280), "p99": ap(298)}
    # TPOT = (e2e - ttft) / (output_tokens - 1): 0.4/4 and 1.0/2; the one-token answer has none
    assert s["tpot_ms"]["mean"] == ap(300) and s["tpot_ms"]["p50"] == ap(300)
    # ITL: every chunk gap of every request, [0.1]*4 + [0.5]*2
    assert s["itl_ms"]["mean"] == ap(1400 / 6) and s["itl_ms"]["p50"] == ap(100)
    assert s["e2el_ms"]["mean"] == ap(2000 / 3) and s["e2el_ms"]["p50"] == ap(500)
    # good: only the first (the second's TPOT 500 > 200, the third's TTFT 300 > 250, the failure never)
    assert s["goodput"]["good"] == 1 and s["goodput"]["share"] == 0.25 and s["goodput"]["request_throughput"] == 0.5
    # $3.6/h for 2 s = $0.002, over 9 output tokens and 3 completed requests
    assert s["cost"]["run_dollars"] == ap(0.002)
    assert s["cost"]["per_1m_output_tokens"] == ap(0.002 / 9 * 1e6) and s["cost"]["per_1k_requests"] == ap(2 / 3)


def test_wire_ttft_and_the_clients_own_share_on_hand_computed_records():
    """The wire TTFT runs from the request's first byte written to the read of the first chunk's bytes; the rest of
    vLLM's TTFT is the client's own, before writing and after reading; the agreement divides both by the server's
    mean time to first chunk."""
    recs = [Record(start=0, sent=0.002, first_read=0.042, ttft=0.043, e2e=0.5, ok=True, output_tokens=4, usage=True),
            Record(start=1, sent=1.004, first_read=1.064, ttft=0.066, e2e=0.6, ok=True, output_tokens=4, usage=True),
            Record(start=2, sent=2.001, e2e=0.01, error="http 429")]   # failed: in no latency
    s = metrics.summarize(recs, duration=2.0)
    ap = pytest.approx
    assert s["ttft_ms"]["mean"] == ap(54.5) and s["wire_ttft_ms"]["mean"] == ap(50) and s["wire_ttft_ms"]["p50"] == ap(50)
    assert s["client_own_ms"] == {"before_write": ap(3), "after_read": ap(1.5)}
    point = {**s, "server_metrics": {"ttfc_mean_ms": 40.0, "e2el_mean_ms": 500.0, "requests": 2, "output_tokens": 8}}
    ag = metrics.agreement(point)
    assert ag["ttft"] == ap(54.5 / 40) and ag["wire_ttft"] == ap(1.25) and ag["e2el"] == ap(1.1)
    # not streamed: no first chunk, no wire TTFT
    plain = metrics.summarize([Record(start=0, sent=0.001, e2e=0.2, ok=True, output_tokens=2, usage=True)], 1.0)
    assert plain["wire_ttft_ms"]["mean"] is None and plain["client_own_ms"] == {"before_write": None,
                                                                                "after_read": None}


def test_failures_only_and_slo_parsing():
    s = metrics.summarize([Record(start=0, error="timeout"), Record(start=0, error="connection")], 1.0)
    assert s["completed"] == 0 and s["failures"] == {"connection": 1, "timeout": 1} and s["success_rate"] == 0
    assert s["ttft_ms"]["p99"] is None and s["output_throughput"] == 0
    busy = [Record(start=0, e2e=e, error="http 429", retry_after=i < 2) for i, e in enumerate((0.1, 0.3, 0.2))]
    s = metrics.summarize(busy + synthetic()[:1], 1.0)
    assert s["failure_latency_ms"]["http 429"] == {"mean": pytest.approx(200), "p50": pytest.approx(200),
                                                    "p90": pytest.approx(280), "p99": pytest.approx(298),
                                                    "max": pytest.approx(300)}
    assert s["failures_with_retry_after"] == 2 and s["completed"] == 1   # 429s kept out of the latency figures
    assert metrics.parse_slos("ttft:500 tpot:50,e2el:2000") == {"ttft": 500, "tpot": 50, "e2el": 2000}
    for bad in ("ttft", "itl:5", "ttft:-1", "ttft:x"):
        with pytest.raises(ValueError):
            metrics.parse_slos(bad)
    records = synthetic() + [Record(start=0, ok=True, text="no usage sent")]
    check = metrics.token_check(records, lambda text: 5)
    assert check == {"checked": 3, "agree": 1, "server_output_tokens": 9, "local_output_tokens": 15, "max_abs_diff": 4}
    assert metrics.summarize(records, 1.0)["without_usage"] == 1
    metrics.fill_missing_tokens(records, lambda text: len(text.split()))
    assert records[-1].output_tokens == 3 and records[0].output_tokens == 5


def test_workload_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}], "max_tokens": 3}\n')
    a, b = jsonl_prompts(f)
    assert a.as_messages() == [{"role": "user", "content": "hi"}] and b.as_text() == "yo" and b.max_tokens == 3
    g = tmp_path / "sg.json"
    g.write_text(json.dumps([{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x" * 40}]},
                             {"conversations": [{"from": "gpt", "value": "skipped"}]}]))
    assert sharegpt_prompts(g) == [Prompt(messages=({"role": "user", "content": "q"},), max_tokens=10)]
    assert parse_length("4:9", "--x") == (4, 9)
    for bad in ("0", "9:4", "a"):
        with pytest.raises(WorkloadError):
            parse_length(bad, "--x")


# ------------------------------------------------------------------------------ failure kinds on a fake wire
def sse(*events: str) -> str:
    return "".join(f"data: {e}\n\n" for e in events)


CHUNK = json.dumps({"choices": [{"index": 0, "delta": {"content": "ab"}}]})
USAGE = json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})


@pytest.mark.parametrize("stream, answer, kind", [
    (True, lambda: httpx.Response(200, text=sse(CHUNK, CHUNK, USAGE, "[DONE]")), None),
    (True, lambda: httpx.Response(200, text=sse(CHUNK, "{not json")), "malformed stream"),
    (True, lambda: httpx.Response(200, text=sse(CHUNK, USAGE)), "malformed stream"),  # no [DONE]
    (True, lambda: httpx.Response(200, text=sse(json.dumps({"error": {"message": "boom"}}))), "malformed stream"),
    (True, lambda: httpx.Response(200, text="hello\n"), "malformed stream"),
    (True, lambda: httpx.Response(503, json={"error": {"message": "busy"}}), "http 503"),
    (False, lambda: httpx.Response(200, text="<html>"), "malformed response"),
    (False, lambda: httpx.Response(429, json={}, headers={"Retry-After": "1"}), "http 429"),
    (False, httpx.ReadTimeout, "timeout"),
    (True, httpx.ConnectError, "connection"),
    (True, httpx.RemoteProtocolError, "connection"),
])
def test_failure_kinds(stream, answer, kind):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] is stream and body["messages"] == [{"role": "user", "content": "q"}]
        assert ("stream_options" in body) is stream and body["seed"] == 1  # --extra-body merged
        if isinstance(answer, type):
            raise answer("simulated", request=request)
        return answer()

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await send(http, Target("A", "http://x", "m", stream=stream, extra_body={"seed": 1}), Prompt("q"), 2)

    rec = asyncio.run(go())
    assert rec.ok is (kind is None) and rec.error == kind and rec.e2e > 0
    assert rec.retry_after is (kind == "http 429")
    if kind is None:
        assert rec.text == "abab" and rec.output_tokens == 2 and rec.prompt_tokens == 4 and len(rec.itl) == 1


def test_timeout_covers_the_whole_request():
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, text=sse("[DONE]"))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await send(http, Target("A", "http://x", "m", timeout=0.05), Prompt("q"), 2)

    rec = asyncio.run(go())
    assert rec.error == "timeout" and not rec.ok and rec.e2e < 4


def test_counters_are_read_until_a_lagging_server_has_published_them():
    """A server behind Ray publishes its replicas' counters about once a second: the point's `after` waits until
    they count its completed requests, its `before` until two reads agree (each at most SETTLE_S)."""
    from unmask.loadtest.metrics import SERVER_COUNTERS
    from unmask.loadtest.run import settled_counters, steady_counters

    key = SERVER_COUNTERS["requests"]
    start = time.perf_counter()

    def handler(request: httpx.Request) -> httpx.Response:  # 10 requests published at once, 6 more after 0.5 s
        n = 16 if time.perf_counter() - start > 0.5 else 10
        return httpx.Response(200, text=f"{key} {n}\n")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            t = Target("A", "http://x", "m")
            after = await settled_counters(http, t, {key: 0.0}, 16)
            waited = time.perf_counter() - start
            steady = await steady_counters(http, t)
            return after, waited, steady

    after, waited, steady = asyncio.run(go())
    assert after[key] == 16 and 0.5 <= waited < 2.0
    assert steady[key] == 16


# ------------------------------------------------------------------------------ against real servers
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("loadtest")
    started = [Server(BUILT_IN, root / "open.log"), Server(BUILT_IN, root / "keyed.log", "--api-key", KEY)]
    yield [s.wait_ready() for s in started]
    for s in started:
        s.stop()


def loadtest(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["loadtest", "--json", str(out), *args])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def check_against_server(point: dict, n: int) -> None:
    assert point["requests"] == n and point["completed"] == n and point["failed"] == 0
    assert set(point) >= POINT_KEYS
    sm = point["server_metrics"]
    assert sm["requests"] == n and sm["output_tokens"] == point["output_tokens"]
    assert sm["prompt_tokens"] == point["input_tokens"] and sm["e2el_mean_ms"] > 0 and sm["mean_step_batch"] >= 1
    # the server's intervals lie inside the client's (both clocks are CLOCK_MONOTONIC): from the request's arrival
    # to the first chunk with text / the last byte, against from sending it to receiving them
    ag = point["agreement"]
    assert ag["requests"] == 1 and ag["output_tokens"] == 1
    assert 0 < sm["e2el_mean_ms"] <= point["e2el_ms"]["mean"] and ag["e2el"] >= 1
    if point["ttft_ms"]["mean"] is None:                       # not streamed: no chunk to time
        assert sm["ttfc_mean_ms"] is None and ag["ttft"] is None
    else:   # the first token is committed before its chunk, which is handed over before the client reads it
        assert 0 < sm["ttft_mean_ms"] <= sm["ttfc_mean_ms"] <= point["wire_ttft_ms"]["mean"] <= point["ttft_ms"]["mean"]
        assert ag["ttft"] >= ag["wire_ttft"] >= 1 and point["client_own_ms"]["before_write"] > 0


def test_time_to_first_chunk_covers_arrival_to_each_choices_first_text_chunk(servers):
    """What the server's histograms cover, request by request: unmask:time_to_first_chunk_seconds one observation
    per choice of a streamed request (none without streaming), unmask:time_to_first_token_seconds one per choice
    either way, and the interval inside the client's wire TTFT (the request's first byte written to the first
    chunk's bytes read), itself inside vLLM's TTFT."""
    url = servers[0].url
    names = ("unmask:time_to_first_chunk_seconds", "unmask:time_to_first_token_seconds",
             "unmask:e2e_request_latency_seconds")

    def histograms() -> dict[str, float]:
        m = metrics.scrape(httpx.get(url + "/metrics", timeout=30).text)
        return {f"{n}_{k}": m.get(f"{n}_{k}", 0.0) for n in names for k in ("count", "sum")}

    async def one(target: Target) -> Record:
        async with httpx.AsyncClient(timeout=120) as http:
            return await send(http, target, Prompt(text="Say hello"), 4)

    def delta(target: Target) -> tuple[Record, dict[str, float]]:
        before = histograms()
        rec = asyncio.run(one(target))
        assert rec.ok, rec.detail
        return rec, {k: v - before[k] for k, v in histograms().items()}

    ttfc, ttft, e2e = names
    rec, d = delta(Target("A", url, "unmask-tiny", ignore_eos=True, extra_body={"n": 2}))
    assert (d[f"{ttfc}_count"], d[f"{ttft}_count"], d[f"{e2e}_count"]) == (2, 2, 1)
    rec, d = delta(Target("A", url, "unmask-tiny", stream=False, ignore_eos=True))
    assert (d[f"{ttfc}_count"], d[f"{ttft}_count"], d[f"{e2e}_count"]) == (0, 1, 1) and rec.first_read is None
    for endpoint in ("chat", "completions"):
        rec, d = delta(Target("A", url, "unmask-tiny", endpoint=endpoint, ignore_eos=True))
        assert (d[f"{ttfc}_count"], d[f"{ttft}_count"], d[f"{e2e}_count"]) == (1, 1, 1), endpoint
        assert rec.start <= rec.sent < rec.first_read <= rec.start + rec.ttft
        assert 0 < d[f"{ttft}_sum"] <= d[f"{ttfc}_sum"] <= rec.first_read - rec.sent <= rec.ttft
        assert d[f"{e2e}_sum"] <= rec.e2e


def test_streamed_chat_concurrency_sweep(servers, tmp_path):
    png = tmp_path / "p.png"
    res = loadtest(tmp_path, "--url", servers[0].url, "-n", "4", "--concurrency", "1,2", "--output-len", "6",
                   "--ignore-eos", "--tokenizer", str(BUILT_IN), "--goodput", "e2el:600000", "--dollars-per-hour", "1",
                   "--plot", str(png))
    assert res["schema_version"] == 1 and res["sweep"] == "concurrency" and res["stream"] is True
    assert res["endpoint"] == "/v1/chat/completions" and res["targets"][0]["model"] == "unmask-tiny"
    assert [p["concurrency"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        check_against_server(p, 4)
        assert p["output_tokens"] == 24  # ignore_eos: exactly max_tokens each
        assert p["ttft_ms"]["p50"] is not None and p["tpot_ms"]["mean"] is not None
        assert p["goodput"]["good"] == 4 and p["cost"]["per_1m_output_tokens"] > 0
        assert p["token_check"]["checked"] == 4 and p["token_check"]["server_output_tokens"] == 24
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_completions_not_streamed_at_poisson_rates(servers, tmp_path):
    res = loadtest(tmp_path, "--url", servers[0].url + "/v1", "--endpoint", "completions", "--no-stream",
                   "-n", "3", "--rate", "20,inf", "--output-len", "2:5", "--extra-body", '{"top_k": 1}')
    assert res["endpoint"] == "/v1/completions" and [p["rate"] for p in res["points"]] == [20.0, "inf"]
    for p in res["points"]:
        check_against_server(p, 3)
        assert p["ttft_ms"]["p50"] is None and p["itl_ms"]["mean"] is None and p["e2el_ms"]["p99"] is not None


def test_wrong_key_is_counted_as_401_failures(servers, tmp_path):
    res = loadtest(tmp_path, "--url", servers[1].url, "--api-key", "wrong", "--model", "unmask-tiny", "-n", "3",
                   "--output-len", "2", "--goodput", "e2el:600000")
    (p,) = res["points"]
    assert p["requests"] == 3 and p["completed"] == 0 and p["failures"] == {"http 401": 3}
    assert p["success_rate"] == 0 and p["goodput"]["share"] == 0 and p["output_throughput"] == 0
    assert "failure_examples" in p and p["server_metrics"] is None  # /metrics is behind the key too


def test_compare_interleaves_two_servers(servers, tmp_path):
    res = loadtest(tmp_path, "--url", servers[0].url, "--compare", servers[1].url, "--compare-api-key", KEY,
                   "-n", "4", "--output-len", "3", "--ignore-eos", "--dataset", "jsonl", "--dataset-path",
                   str(write_jsonl(tmp_path)))
    assert [(p["target"], p["concurrency"]) for p in res["points"]] == [("A", 1), ("B", 1)]
    assert res["workload"]["rounds"] == 2 and res["ratios"][0]["output_throughput"] > 0
    for p in res["points"]:
        check_against_server(p, 4)
        assert p["output_tokens"] == 12


def test_compare_with_the_same_server_warns_of_its_prefix_cache(servers, tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["loadtest", "--json", str(out), "--url", servers[0].url, "--compare",
                                 servers[0].url + "/v1", "-n", "2", "--output-len", "2", "--ignore-eos", "--dataset",
                                 "jsonl", "--dataset-path", str(write_jsonl(tmp_path))])
    assert r.exit_code == 0, r.output
    assert "warning: --compare is the --url server: B's prompts reach a prefix cache" in r.output
    assert [p["target"] for p in json.loads(out.read_text())["points"]] == ["A", "B"]


def test_a_burst_against_a_short_queue(tmp_path):
    """A 2-slot server: --burst (raw sockets, bench/serve_load.py's) answers exactly 2 requests 200 and the rest 429
    with Retry-After and the envelope; --rate inf with --preconnect sees the same split and the server's /metrics
    counted the same 429s."""
    s = Server(BUILT_IN, tmp_path / "small.log", "--max-num-seqs", "1", "--max-queue", "1").wait_ready()
    try:
        out = tmp_path / "burst.json"
        r = CliRunner().invoke(app, ["loadtest", "--url", s.url, "--burst", "12", "--output-len", "64",
                                     "--ignore-eos", "--json", str(out)])
        assert r.exit_code == 0, r.output
        b = json.loads(out.read_text())["burst"]
        assert b["statuses"] == {"200": 2, "429": 10} and b["connection_errors"] == 0 and b["200_complete"] == 2
        assert b["429_with_retry_after"] == b["429_envelopes"] == 10
        assert 0 < b["429_status_ms"]["p50"] <= b["429_status_ms"]["max"] and b["200_status_ms"]["p50"] > 0
        assert "statuses {'200': 2, '429': 10}" in r.output
        res = loadtest(tmp_path, "--url", s.url, "--rate", "inf", "-n", "16", "--preconnect", "16", "--output-len",
                       "16", "--ignore-eos", "--warmup", "0")
    finally:
        s.stop()
    (p,) = res["points"]
    busy = p["failures"].get("http 429", 0)
    assert busy >= 1 and p["completed"] >= 2 and p["completed"] + busy == 16, p["failures"]
    assert p["failures_with_retry_after"] == busy and p["output_tokens"] == 16 * p["completed"]
    lat = p["failure_latency_ms"]["http 429"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"] and res["workload"]["preconnect"] == 16
    assert p["server_metrics"]["errors"] == busy and p["server_metrics"]["requests"] == p["completed"]


def write_jsonl(tmp_path: Path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "def add(a, b):"}\n{"messages": [{"role": "user", "content": "Hello"}]}\n')
    return f


@pytest.mark.parametrize("args, says", [
    (["--endpoint", "embeddings"], "--endpoint"),
    (["--rate", "0"], "--rate"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--goodput", "ttft:fast"], "--goodput"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--dataset", "jsonl"], "--dataset-path"),
    (["--dataset", "sharegpt", "--dataset-path", "/nonexistent.json"], "not found"),
    (["--url", "localhost:8000"], "--url"),
    (["--url", "http://127.0.0.1:9", "--model", "m"], "cannot reach"),
    (["--json", "/nonexistent/dir/r.json"], "--json"),
    (["--preconnect", "-1"], "--preconnect"),
    (["--burst", "5", "--rate", "inf"], "--burst"),
])
def test_bad_input_is_one_line(args, says):
    r = CliRunner().invoke(app, ["loadtest", "--warmup", "1", *args])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.output
    assert "Traceback" not in r.output and not isinstance(r.exception, (ValueError, TypeError, KeyError))


def test_bad_jsonl_line_is_one_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    r = CliRunner().invoke(app, ["loadtest", "--dataset", "jsonl", "--dataset-path", str(f)])
    assert r.exit_code == 1 and r.output.strip() == f"error: {f}:2: expected 'prompt' (a string) or 'messages' " \
                                                   f"(a list of role/content)"


@pytest.mark.skipif(not Path("data/corpus/heldout.jsonl").is_file(), reason="no data/corpus")
def test_heldout_tasks_workload(servers, tmp_path):
    res = loadtest(tmp_path, "--url", servers[0].url, "--endpoint", "completions", "--dataset", "heldout",
                   "-n", "2", "--output-len", "4", "--warmup", "0")
    check_against_server(res["points"][0], 2)
    assert math.isfinite(res["points"][0]["e2el_ms"]["mean"])


@pytest.mark.skipif(not (AR_TWIN / "model.safetensors").is_file(), reason="no AR twin")
def test_compare_against_a_second_engine(servers, tmp_path):
    """bench/ar_twin_server.py (transformers, the AR twin) as target B: another engine, no /metrics."""
    port = free_port()
    log = (tmp_path / "twin.log").open("w")
    twin = subprocess.Popen([sys.executable, str(ROOT / "bench" / "ar_twin_server.py"), "--model", str(AR_TWIN),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert twin.poll() is None and time.monotonic() < deadline, (tmp_path / "twin.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        res = loadtest(tmp_path, "--url", servers[0].url, "--compare", f"http://127.0.0.1:{port}", "-n", "2",
                       "--output-len", "3", "--ignore-eos", "--concurrency", "2")
        # a model id the second engine does not serve: every request fails as its 404, none is dropped
        wrong = loadtest(tmp_path, "--url", f"http://127.0.0.1:{port}", "--model", "no-such-model", "-n", "3",
                         "--output-len", "2", "--warmup", "0", "--goodput", "e2el:600000")
    finally:
        twin.terminate()
        twin.wait(30)
    a, b = res["points"]
    assert res["targets"][1]["model"] == "ar-twin" and (a["target"], b["target"]) == ("A", "B")
    check_against_server(a, 2)
    assert set(b) >= POINT_KEYS and b["requests"] == b["completed"] == 2 and b["failures"] == {}
    assert b["output_tokens"] == 6 and b["without_usage"] == 0 and b["input_tokens"] > 0
    assert b["server_metrics"] is None and b["agreement"] is None
    assert b["ttft_ms"]["p50"] is not None and b["wire_ttft_ms"]["mean"] <= b["ttft_ms"]["mean"]
    assert res["ratios"][0]["output_throughput"] > 0
    (w,) = wrong["points"]
    assert (w["requests"], w["completed"], w["failures"]) == (3, 0, {"http 404": 3})
    assert w["success_rate"] == 0 and w["goodput"]["share"] == 0 and "no-such-model" in w["failure_examples"]["http 404"]
