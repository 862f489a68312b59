"""Prometheus metrics of one server, in their own registry (several apps may live in one process)."""
from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import SummaryMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPF_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12, 16, 24, 32, 64)


# time.perf_counter() when the request being handled reached the server: set by the admission gate when a
# generation request's headers have been read (before its body), so the latency histograms start where a client's
# clock does, less the network (docs/loadtest.md, "Agreement with /metrics")
request_arrival: ContextVar[float | None] = ContextVar("unmask_request_arrival", default=None)


def arrival() -> float:
    """When the request being handled arrived (request_arrival), or now for one that came in another way (a batch
    line run in-process)."""
    t = request_arrival.get()
    return time.perf_counter() if t is None else t


class EngineStatsCollector:
    """Reads the engine's cumulative step counters at scrape time (no work on the step path).

    `unmask:step_batch_size` is a summary: _count = steps taken, _sum = requests over all steps,
    so sum / count is the mean number of requests per forward.
    """

    def __init__(self, stats: Callable[[], object | None]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        steps, batch, fwd = (s.steps, s.batch_size_sum, s.forward_s) if s is not None else (0, 0, 0.0)
        yield SummaryMetricFamily("unmask:step_batch_size", "Requests in each engine step (forward).",
                                  count_value=steps, sum_value=batch)
        yield SummaryMetricFamily("unmask:forward_seconds", "Time in model forwards per engine step.",
                                  count_value=steps, sum_value=fwd)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("unmask:time_to_first_token_seconds",
                              "Time from arrival to the first committed token of a choice.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.ttfc = Histogram("unmask:time_to_first_chunk_seconds",
                              "Time from arrival to the first stream chunk with generated text of a choice, handed "
                              "to the HTTP layer (streamed chat and completions): a client's TTFT less the network.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("unmask:e2e_request_latency_seconds",
                             "Time from arrival to the last byte of a successful request.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_forward = Histogram("unmask:tokens_per_forward",
                                            "Generated tokens per forward of each finished choice.",
                                            buckets=TPF_BUCKETS, registry=r)
        self.prompt_tokens = Counter("unmask:prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter("unmask:generation_tokens", "Tokens committed.", registry=r)
        self.cancellations = Counter("unmask:request_cancellations",
                                     "Requests cancelled because the client went away.", registry=r)
        self.errors = Counter("unmask:request_errors", "Requests answered with an error.", ["status"],
                              registry=r)
        self.running = Gauge("unmask:num_requests_running", "Engine requests in the running batch.",
                             registry=r)
        self.waiting = Gauge("unmask:num_requests_waiting", "Engine requests waiting for a slot.",
                             registry=r)
        self._engine = None
        self.running.set_function(lambda: self._engine.num_running if self._engine else 0)
        self.waiting.set_function(lambda: self._engine.num_waiting if self._engine else 0)
        r.register(EngineStatsCollector(lambda: self._engine.stats if self._engine else None))

    def attach(self, engine) -> None:
        """Start reading gauges from `engine` (an `unmask.engine.engine.Engine`) once it is loaded."""
        self._engine = engine

    def error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
