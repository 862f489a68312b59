"""The figures of one run from its records, as vLLM's `bench serve` defines them (docs/loadtest.md).
Pure functions of `Record`s and the run's wall time: no I/O, no clocks."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

from unmask.loadtest.client import Record

SLO_KEYS = ("ttft", "tpot", "e2el")  # milliseconds, as vLLM's --goodput
PERCENTILES = (50, 90, 99)


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, which vLLM uses); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats_ms(xs: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of seconds, in milliseconds (None where there is no sample)."""
    out = {"mean": 1e3 * sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        p = percentile(xs, q)
        out[f"p{q}"] = None if p is None else 1e3 * p
    return out


def tpot(rec: Record) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (output_tokens - 1); None unless streamed with
    more than one output token."""
    if rec.ttft is None or not rec.output_tokens or rec.output_tokens < 2:
        return None
    return (rec.e2e - rec.ttft) / (rec.output_tokens - 1)


def _mean_ms(xs: Sequence[float]) -> float | None:
    return 1e3 * sum(xs) / len(xs) if xs else None


def client_own(done: Sequence[Record]) -> dict[str, float | None]:
    """This client's own share of the TTFT, mean ms: before the request's first byte was written (building it, the
    connection pool, a new connection) and after the first chunk's bytes were read (SSE lines and JSON)."""
    timed = [r for r in done if r.first_read is not None and r.sent is not None]
    return {"before_write": _mean_ms([r.sent - r.start for r in timed]),
            "after_read": _mean_ms([r.start + r.ttft - r.first_read for r in timed])}


def parse_slos(spec: str) -> dict[str, float]:
    """'ttft:500 tpot:50' (or comma-separated) -> {"ttft": 500.0, "tpot": 50.0}, milliseconds."""
    slos: dict[str, float] = {}
    for item in spec.replace(",", " ").split():
        key, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in SLO_KEYS or not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput takes KEY:MS pairs with KEY one of {', '.join(SLO_KEYS)} and MS > 0, "
                             f"got {item!r}")
        slos[key] = ms
    return slos


def is_good(rec: Record, slos: dict[str, float]) -> bool:
    """A completed request that meets every SLO (vLLM: a one-token answer has TPOT 0)."""
    if not rec.ok:
        return False
    values = {"ttft": rec.ttft, "tpot": tpot(rec) if (rec.output_tokens or 0) > 1 else 0.0, "e2el": rec.e2e}
    return all(values[k] is not None and 1e3 * values[k] <= ms for k, ms in slos.items())


def cost(dollars_per_hour: float | None, duration: float, output_tokens: int, completed: int) -> dict | None:
    """The run's machine time at $/hour spread over what it delivered."""
    if dollars_per_hour is None:
        return None
    run = dollars_per_hour * duration / 3600
    return {"dollars_per_hour": dollars_per_hour, "run_dollars": run,
            "per_1m_output_tokens": run / output_tokens * 1e6 if output_tokens else None,
            "per_1k_requests": run / completed * 1e3 if completed else None}


def summarize(records: Sequence[Record], duration: float, slos: dict[str, float] | None = None,
              dollars_per_hour: float | None = None) -> dict:
    """Every figure of one sweep point. Failed requests count in `requests` and in success_rate's and
    goodput_share's denominators; their latency is not mixed into the latency figures."""
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens or 0 for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    n = len(records)
    summary = {
        "requests": n, "completed": len(done), "failed": n - len(done),
        "failures": dict(sorted(Counter(r.error for r in records if not r.ok).items())),
        "success_rate": len(done) / n if n else None,
        "without_usage": sum(not r.usage for r in done),
        "duration_s": duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
        "ttft_ms": stats_ms([r.ttft for r in done if r.ttft is not None]),
        # the part of the TTFT a server can time: from the request's first byte written to the first chunk's read
        "wire_ttft_ms": stats_ms([r.first_read - r.sent for r in done if r.first_read is not None and r.sent]),
        "client_own_ms": client_own(done),
        "tpot_ms": stats_ms([t for r in done if (t := tpot(r)) is not None]),
        "itl_ms": stats_ms([g for r in done for g in r.itl]),
        "e2el_ms": stats_ms([r.e2e for r in done]),
        # how long each kind of failure took to come back (a 429 on arrival should be fast), max included
        "failure_latency_ms": {kind: {**stats_ms(xs), "max": 1e3 * max(xs)}
                               for kind in sorted({r.error for r in records if not r.ok})
                               if (xs := [r.e2e for r in records if r.error == kind])},
        "failures_with_retry_after": sum(r.retry_after for r in records if not r.ok),
    }
    if slos:
        good = sum(is_good(r, slos) for r in records)
        summary["goodput"] = {"slos_ms": slos, "good": good,
                              "request_throughput": good / duration if duration > 0 else None,
                              "share": good / n if n else None}
    summary["cost"] = cost(dollars_per_hour, duration, out_tokens, len(done))
    return summary


def token_check(records: Sequence[Record], count: Callable[[str], int]) -> dict:
    """Server usage against a local tokenizer's count of each completed answer's text. Decoding then
    re-encoding need not give back the same ids, so a small share of disagreements is expected."""
    pairs = [(r.output_tokens, count(r.text)) for r in records if r.ok and r.usage]
    return {"checked": len(pairs), "agree": sum(a == b for a, b in pairs),
            "server_output_tokens": sum(a for a, _ in pairs), "local_output_tokens": sum(b for _, b in pairs),
            "max_abs_diff": max((abs(a - b) for a, b in pairs), default=0)}


def fill_missing_tokens(records: Sequence[Record], count: Callable[[str], int]) -> None:
    """Completed answers without usage get the local tokenizer's count of their text (as vLLM does)."""
    for r in records:
        if r.ok and not r.usage:
            r.output_tokens = count(r.text)


def scrape(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over labels}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
            except ValueError:
                continue
    return out


SERVER_COUNTERS = {"requests": "unmask:e2e_request_latency_seconds_count",
                   "output_tokens": "unmask:generation_tokens_total",
                   "prompt_tokens": "unmask:prompt_tokens_total",
                   "errors": "unmask:request_errors_total"}
# means of the server's histograms and summaries over the point: name -> (sum sample, count sample, scale)
SERVER_MEANS = {"e2el_mean_ms": ("unmask:e2e_request_latency_seconds", 1e3),
                "ttft_mean_ms": ("unmask:time_to_first_token_seconds", 1e3),
                "ttfc_mean_ms": ("unmask:time_to_first_chunk_seconds", 1e3),
                "mean_step_batch": ("unmask:step_batch_size", 1.0),
                "tokens_per_forward": ("unmask:tokens_per_forward", 1.0)}


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None] | None:
    """What an unmask server's own /metrics saw during a sweep point: counter deltas, and the means of its
    latency histograms (server side, from a request's arrival: to the first committed token, to the first chunk
    with text handed to the HTTP layer, to the last byte) and of its step batch size and tokens per forward. None
    for a server without these metrics."""
    if SERVER_COUNTERS["requests"] not in after:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out: dict[str, float | None] = {k: delta(name) for k, name in SERVER_COUNTERS.items()}
    for key, (name, scale) in SERVER_MEANS.items():
        n = delta(f"{name}_count")
        out[key] = scale * delta(f"{name}_sum") / n if n else None
    return out


def agreement(point: dict) -> dict[str, float | None] | None:
    """The client's figures over the server's own for the same requests (1.0: the same): mean TTFT (vLLM's, which
    includes this client's own work) and mean wire TTFT (from the request's first byte written to the first
    chunk's bytes read) over the server's mean time to first chunk (from the request's arrival to that chunk handed
    to the HTTP layer: inside both, so neither ratio is below 1), mean end-to-end latency, completed requests and
    output tokens. None without server metrics."""
    sm = point.get("server_metrics")
    if not sm:
        return None

    def ratio(client, server):
        return client / server if client is not None and server else None

    return {"ttft": ratio(point["ttft_ms"]["mean"], sm.get("ttfc_mean_ms")),
            "wire_ttft": ratio(point["wire_ttft_ms"]["mean"], sm.get("ttfc_mean_ms")),
            "e2el": ratio(point["e2el_ms"]["mean"], sm.get("e2el_mean_ms")),
            "requests": ratio(point["completed"], sm["requests"]),
            "output_tokens": ratio(point["output_tokens"], sm["output_tokens"])}
