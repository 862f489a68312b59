"""A whole load test: the sweep over concurrency levels or request rates, each point on every target, in
rounds that alternate the targets (A B A B) so that drift on a shared machine hits both alike; the server's
own /metrics scraped around each point; the records summarised by unmask.loadtest.metrics."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from unmask.loadtest import metrics
from unmask.loadtest.client import Record, Target, closed_loop, poisson, preconnect, send
from unmask.loadtest.workloads import Prompt


class LoadtestError(RuntimeError):
    """A run that cannot start (no server, no model): one line for the user."""


@dataclass
class Plan:
    sweep: str  # "concurrency" | "rate"
    values: list[float]
    work: list[tuple[Prompt, int]]  # per sweep point, the same for every target
    rounds: int = 1
    max_concurrency: int | None = None
    warmup: int = 1
    seed: int = 0
    slos: dict | None = None
    dollars_per_hour: float | None = None
    preconnect: int = 0   # keep-alive connections opened (untimed) before each round on each target


async def resolve_model(http: httpx.AsyncClient, target: Target) -> None:
    if target.model:
        return
    try:
        r = await http.get(f"{target.url}/v1/models", headers=target.headers())
    except httpx.HTTPError as e:
        raise LoadtestError(f"cannot reach {target.url} ({type(e).__name__}: {e})") from None
    try:
        r.raise_for_status()
        target.model = r.json()["data"][0]["id"]
    except (httpx.HTTPStatusError, ValueError, KeyError, IndexError, TypeError):
        raise LoadtestError(f"could not read a model id from {target.url}/v1/models (HTTP {r.status_code}); "
                            f"pass --model") from None


async def server_counters(http: httpx.AsyncClient, target: Target) -> dict[str, float]:
    try:
        r = await http.get(f"{target.url}/metrics", headers=target.headers())
        return metrics.scrape(r.text) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


# a server behind Ray publishes each replica's counters to its /metrics about once a second: read them until they
# count every request the point completed, for at most this long (a plain server counts them at once)
SETTLE_S = 3.0


async def settled_counters(http: httpx.AsyncClient, target: Target, before: dict[str, float],
                           completed: int) -> dict[str, float]:
    """The server's counters once they include the point's `completed` requests (or SETTLE_S passed)."""
    key = metrics.SERVER_COUNTERS["requests"]
    deadline = time.perf_counter() + SETTLE_S
    while True:
        after = await server_counters(http, target)
        if key not in after or after[key] - before.get(key, 0.0) >= completed or time.perf_counter() > deadline:
            return after
        await asyncio.sleep(0.2)


async def steady_counters(http: httpx.AsyncClient, target: Target) -> dict[str, float]:
    """The server's counters once two reads a publishing interval apart agree (or SETTLE_S passed): a point's
    `before` must not miss requests that finished earlier (the warm-up's) and were not yet published."""
    key = metrics.SERVER_COUNTERS["requests"]
    deadline = time.perf_counter() + SETTLE_S
    first = await server_counters(http, target)
    while key in first and time.perf_counter() < deadline:
        await asyncio.sleep(1.1)
        again = await server_counters(http, target)
        if again.get(key) == first.get(key):
            return again
        first = again
    return first


async def run(targets: list[Target], plan: Plan, timeout: float, advance: Callable[[], None] = lambda: None,
              count_tokens: Callable[[str], int] | None = None) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), limits=limits) as http:
        for t in targets:
            await resolve_model(http, t)
        for t in targets:  # first requests pay for lazy loading and compilation: not measured
            for prompt, max_tokens in plan.work[:plan.warmup]:
                rec = await send(http, t, prompt, max_tokens)
                if rec.error == "connection":
                    raise LoadtestError(f"cannot reach {t.url} ({rec.detail})")
        points = []
        for x in plan.values:
            records: dict[str, list[Record]] = {t.name: [] for t in targets}
            duration = dict.fromkeys(records, 0.0)
            before = {t.name: await steady_counters(http, t) for t in targets}
            size = -(-len(plan.work) // plan.rounds)
            for r in range(plan.rounds):
                chunk = plan.work[r * size:(r + 1) * size]
                for t in targets:
                    if plan.preconnect:
                        await preconnect(http, t, plan.preconnect)
                    t0 = time.perf_counter()
                    if plan.sweep == "concurrency":
                        got = await closed_loop(http, t, chunk, int(x), advance)
                    else:
                        got = await poisson(http, t, chunk, x, plan.max_concurrency, plan.seed + r, advance)
                    duration[t.name] += time.perf_counter() - t0
                    records[t.name] += got
            for t in targets:
                recs = records[t.name]
                after = await settled_counters(http, t, before[t.name], sum(r.ok for r in recs))
                check = metrics.token_check(recs, count_tokens) if count_tokens else None
                if count_tokens:
                    metrics.fill_missing_tokens(recs, count_tokens)
                point = {"target": t.name, plan.sweep: x,
                         **metrics.summarize(recs, duration[t.name], plan.slos, plan.dollars_per_hour),
                         "server_metrics": metrics.server_delta(before[t.name], after),
                         "token_check": check,
                         "failure_examples": {k: next(r.detail for r in recs if r.error == k)
                                              for k in sorted({r.error for r in recs if not r.ok})}}
                point["agreement"] = metrics.agreement(point)
                points.append(point)
        return points


def run_sync(*args, **kw) -> list[dict]:
    return asyncio.run(run(*args, **kw))
