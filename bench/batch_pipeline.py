"""Batch pipelines on the built-in model (issue 33): offline `unmask batch` against the server's /v1/batches on
the same file (items/s), and an interactive request's latency on an idle server against one running a batch.

    python bench/batch_pipeline.py [--lines 200] [--max-tokens 16] [--max-num-seqs 16] [--probes 12] [--threads 1]

Both sides run as subprocesses with the same OMP_NUM_THREADS (--threads): on 2 cores shared with other jobs,
two torch threads made `unmask serve` 13x slower than one (1.2 against 16 lines/s, 2026-12-05), which would
measure the machine, not the pipeline. Every request is a short chat line ("Classify: ...") decoded greedy. Both paths run the same route code
(unmask.batch.execute); the server path adds SQLite writes, the client's polling and the batch in-flight bound
(--batch-max-inflight at its default, three quarters of --max-num-seqs). The latency probes are sequential chat
requests (max_tokens 16) sent first to the idle server, then while a batch of --lines * 4 lines runs. Prints a
table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

WORDS = "apple river stone cloud laptop violin tiger bread candle rocket".split()


def lines(n: int, max_tokens: int, prefix: str = "r") -> list[dict]:
    return [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": f"Classify: {WORDS[i % 10]} {WORDS[(i * 7) % 10]} {i}"}],
                      "max_tokens": max_tokens, "temperature": 0.0}} for i in range(n)]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Server:
    def __init__(self, data: Path, port: int, *flags: str):
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "unmask.cli", "serve", "--port", str(port), "--data-dir", str(data),
               "--log-level", "warning", "--embedding-model", "off", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, "server exited"
            time.sleep(0.1)

    def batch(self, path: Path):
        file_id = self.client.files.create(file=path.open("rb"), purpose="batch").id
        return self.client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h")

    def wait(self, batch_id: str, statuses=("completed", "failed")):
        while (b := self.client.batches.retrieve(batch_id)).status not in statuses:
            time.sleep(0.05)
        return b

    def probe(self, n: int) -> list[float]:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            self.client.chat.completions.create(model="unmask-tiny", max_tokens=16, temperature=0.0,
                                                messages=[{"role": "user", "content": f"Say hello {i}."}])
            out.append(time.perf_counter() - t0)
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--probes", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both subprocesses")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    path = write(tmp / "in.jsonl", lines(args.lines, args.max_tokens))
    result: dict = {"lines": args.lines, "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
                    "threads": args.threads}

    offline = subprocess.run([sys.executable, "-m", "unmask.cli", "batch", str(path), str(tmp / "out.jsonl"),
                              "--max-num-seqs", str(args.max_num_seqs), "--no-progress"],
                             capture_output=True, text=True, check=True)
    # its last line: "N succeeded, ...; R requests/s" (model load excluded, as for the server below)
    result["offline_items_per_s"] = float(offline.stderr.strip().splitlines()[-1].split("; ")[-1].split()[0])

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = Server(tmp / "data", port, "--max-num-seqs", str(args.max_num_seqs))
    try:
        t0 = time.perf_counter()
        b = server.wait(server.batch(path).id)
        result["server_items_per_s"] = b.request_counts.completed / (time.perf_counter() - t0)
        idle = server.probe(args.probes)
        running = server.batch(write(tmp / "long.jsonl", lines(args.lines * 4, args.max_tokens, "long")))
        server.wait(running.id, ("in_progress",))
        time.sleep(1.0)   # lines in flight
        busy = server.probe(args.probes)
        still = server.client.batches.retrieve(running.id)
        server.client.batches.cancel(running.id)
        result.update(idle_latency_s=statistics.median(idle), busy_latency_s=statistics.median(busy),
                      idle_latency_max_s=max(idle), busy_latency_max_s=max(busy),
                      batch_lines_done_during_probes=still.request_counts.completed,
                      batch_still_running_after_probes=still.status == "in_progress")
    finally:
        server.stop()

    result["server_over_offline"] = result["server_items_per_s"] / result["offline_items_per_s"]
    result["busy_over_idle_latency"] = result["busy_latency_s"] / result["idle_latency_s"]
    for k, v in result.items():
        print(f"{k:>40} {v:.3f}" if isinstance(v, float) else f"{k:>40} {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
