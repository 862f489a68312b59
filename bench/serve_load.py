"""Load benchmark of a running `unmask serve`: closed-loop clients at several concurrency levels.

    python bench/serve_load.py --url http://127.0.0.1:8000 --concurrency 1,2,4,8,16,32 --requests 64 --max-tokens 64

Each request is a streamed chat completion with a fresh prompt (seeded), greedy, `ignore_eos` so
that every answer has exactly --max-tokens tokens. Per level it reports time to first token (first
non-empty content chunk), inter-chunk latency (gap between content chunks: a chunk carrying a
whole block counts once), end-to-end latency, output tokens/s over the level's wall time, and from
/metrics the mean step batch size (requests per forward) and tokens per forward. Prints a table,
then one JSON line.

    python bench/serve_load.py --url http://127.0.0.1:8000 --burst 500 --max-tokens 64

With --burst N it instead sends N streamed chat requests at once (the overload case: run the server
with a small --max-queue) and reports how many got 200 and 429, whether every 429 carried Retry-After
and the error envelope, and the 429s' latency (p50/p90/p99/max: from writing the request to reading
its status line). The burst uses raw sockets, all opened (untimed) before the requests are written,
so that a client library's per-request work does not queue up in the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from unmask.loadtest.burst import burst_request  # the same raw-socket request as unmask loadtest --burst

WORDS = ("river stone light paper garden engine window silver morning cloud forest number music "
         "market letter bridge winter orange signal harbor").split()


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def scrape(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def one_request(http: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, last, gaps, tokens = None, None, [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
    return {"ttft": ttft, "gaps": gaps, "e2e": time.perf_counter() - t0, "tokens": tokens}


async def run_level(http: httpx.AsyncClient, args, concurrency: int, rng: random.Random) -> dict:
    bodies = [{"model": args.model, "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True},
               "messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=args.prompt_words))}]}
              for _ in range(args.requests)]
    todo = iter(bodies)
    results: list[dict] = []

    async def worker():
        for body in todo:
            results.append(await one_request(http, body))

    before = scrape((await http.get("/metrics")).text)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    after = scrape((await http.get("/metrics")).text)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    gaps = [g for r in results for g in r["gaps"]]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    e2e = [r["e2e"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    steps = delta("unmask:step_batch_size_count")
    finished = delta("unmask:tokens_per_forward_count")
    return {
        "concurrency": concurrency, "requests": len(results), "wall_s": wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "output_tok_s": tokens / wall, "req_s": len(results) / wall,
        "mean_step_batch": delta("unmask:step_batch_size_sum") / steps if steps else float("nan"),
        "tokens_per_forward": delta("unmask:tokens_per_forward_sum") / finished if finished else float("nan"),
    }


async def run_burst(args) -> dict:
    """--burst N: N streamed chat requests written at once; 200s are read to the end, 429s checked."""
    url = httpx.URL(args.url)
    headers = {"Host": f"{url.host}:{url.port}", "Content-Type": "application/json", "Connection": "close"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    rng = random.Random(args.seed)
    payloads = []
    for _ in range(args.burst):
        body = json.dumps({"model": args.model, "max_tokens": args.max_tokens, "temperature": 0.0,
                           "ignore_eos": True, "stream": True, "messages": [
                               {"role": "user", "content": " ".join(rng.choices(WORDS, k=args.prompt_words))}]})
        head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Length": len(body)}.items())
        payloads.append(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n{body}".encode())
    go = asyncio.Event()
    tasks = [asyncio.create_task(burst_request(url.host, url.port, p, go)) for p in payloads]
    await asyncio.sleep(0.5)  # let every connection open before the burst
    t0 = time.perf_counter()
    go.set()
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    by_status: dict[int, int] = {}
    for r in results:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    busy = [r for r in results if r["status"] == 429]
    lat = [r["latency"] for r in busy]
    ok = [r for r in results if r["status"] == 200]
    return {
        "burst": args.burst, "statuses": {str(k): v for k, v in sorted(by_status.items())}, "wall_s": wall,
        "429_with_retry_after": sum("retry-after" in r["headers"] for r in busy),
        "429_envelopes": sum(json.loads(r["body"]).get("error", {}).get("type") == "rate_limit_error" for r in busy),
        "200_complete": sum(b"data: [DONE]" in r["body"] for r in ok),
        "429_p50_ms": 1e3 * percentile(lat, 50), "429_p90_ms": 1e3 * percentile(lat, 90),
        "429_p99_ms": 1e3 * percentile(lat, 99), "429_max_ms": 1e3 * max(lat, default=float("nan")),
        "200_status_p50_ms": 1e3 * percentile([r["latency"] for r in ok], 50),
    }


async def main_async(args) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600, limits=limits) as http:
        (await http.get("/health")).raise_for_status()
        if args.model is None:
            args.model = (await http.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        await run_level(http, argparse.Namespace(**{**vars(args), "requests": 2}), 1, rng)  # warm-up
        if args.burst:
            return [await run_burst(args)]
        return [await run_level(http, args, c, rng) for c in args.concurrency]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst", type=int, default=0, help="send this many streamed requests at once instead")
    args = p.parse_args()
    rows = asyncio.run(main_async(args))
    if args.burst:
        row = rows[0]
        print(f"burst of {row['burst']}: statuses {row['statuses']}, {row['200_complete']} streams complete, "
              f"{row['429_with_retry_after']} 429s with Retry-After, {row['429_envelopes']} with the error envelope")
        print(f"429 latency ms: p50 {row['429_p50_ms']:.1f}  p90 {row['429_p90_ms']:.1f}  "
              f"p99 {row['429_p99_ms']:.1f}  max {row['429_max_ms']:.1f}  (200 status p50 "
              f"{row['200_status_p50_ms']:.1f}; burst over in {row['wall_s']:.2f} s)")
        print(json.dumps({"url": args.url, "model": args.model, "max_tokens": args.max_tokens, **row}))
        return
    cols = [("conc", "concurrency", "d"), ("TTFT p50 ms", "ttft_p50_ms", ".1f"), ("TTFT p99 ms", "ttft_p99_ms", ".1f"),
            ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"), ("E2E p50 s", "e2e_p50_s", ".2f"),
            ("E2E p99 s", "e2e_p99_s", ".2f"), ("out tok/s", "output_tok_s", ".1f"), ("req/s", "req_s", ".2f"),
            ("batch", "mean_step_batch", ".2f"), ("tok/fwd", "tokens_per_forward", ".2f")]
    print(" | ".join(h for h, _, _ in cols))
    for row in rows:
        print(" | ".join(f"{row[k]:{f}}".rjust(len(h)) for h, k, f in cols))
    print(json.dumps({"url": args.url, "model": args.model, "max_tokens": args.max_tokens,
                      "requests": args.requests, "levels": rows}))


if __name__ == "__main__":
    main()
