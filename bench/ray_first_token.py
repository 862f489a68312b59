"""When the parts of a streamed chat answer arrive, plain `unmask serve` (A) against `unmask serve --ray` (B), requests
alternating A B A B: the response headers, the role chunk (sent before decoding starts) and the first chunk with
text, in ms after the request, medians (docs/scale-out.md, "The response's direct path").

    python bench/ray_first_token.py http://127.0.0.1:8371 http://127.0.0.1:8372 --requests 40
"""
import argparse
import http.client
import json
import statistics
import time
from urllib.parse import urlparse

BODY = {"model": "unmask-tiny", "messages": [{"role": "user", "content": "Tell me about the history of the sea " * 3}],
        "max_tokens": 8, "stream": True, "ignore_eos": True}


def one(url: str, model: str) -> tuple[float, float, float]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(dict(BODY, model=model)),
                 {"content-type": "application/json"})
    response = conn.getresponse()
    headers, role, text, seen = time.perf_counter(), None, None, b""
    while chunk := response.read1(65536):
        now, seen = time.perf_counter(), seen + chunk
        if role is None and b'"role"' in seen:
            role = now
        if text is None and b'"content":"' in seen.replace(b'"content":""', b""):
            text = now
    conn.close()
    if role is None or text is None:
        raise SystemExit(f"{url}: no role chunk or no text in the answer: {seen[:200]!r}")
    return tuple((t - t0) * 1e3 for t in (headers, role, text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--model", default="unmask-tiny")
    args = ap.parse_args()
    times = {"A": [], "B": []}
    for i in range(args.requests + 2):   # the first two of each: warm-up, left out
        for name, url in (("A", args.a), ("B", args.b)):
            t = one(url, args.model)
            if i >= 2:
                times[name].append(t)
    for name, rows in times.items():
        headers, role, text = (statistics.median(r[k] for r in rows) for k in range(3))
        print(f"{name}: headers {headers:.1f} ms, role chunk {role:.1f} ms, first text {text:.1f} ms "
              f"(medians of {len(rows)})")


if __name__ == "__main__":
    main()
