"""OpenMP's wait policy against decoding speed: `unmask generate` and `unmask serve` (under `unmask loadtest`) with
OMP_WAIT_POLICY unset (libgomp spins a while at every barrier before it sleeps) against PASSIVE (threads sleep
at once), interleaved (A B, B A, ...).

The policy is read when torch's OpenMP runtime loads, so each run is its own process; the tokens/s are the
ones `--stats` prints (decoding only, the model load excluded). On a machine whose cores are busy with other
work a spinning thread holds a core its partner needs, and a step waits for a time slice at every barrier:
under load the spread is 10-40x (docs/benchmarks.md). This measures what PASSIVE costs or saves on the
machine it runs on, which is the number a default needs; say the load average beside it.

    .venv/bin/python bench/omp_wait.py --rounds 3 --json docs/bench/omp-wait.json               # as the machine is
    .venv/bin/python bench/omp_wait.py --rounds 3 --burners 2 --json docs/bench/omp-wait-shared.json  # 2 busy neighbours
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from benchlib.common import interleave, ratio_summary, summary, write_json  # noqa: E402

POLICIES = ("unset", "PASSIVE")  # --policies adds e.g. spin:20000 (GOMP_SPINCOUNT: spin that long, then sleep)
CASES = {  # name -> generate arguments: short decoding, and a long prompt whose prefill dominates
    "decode": ["def fibonacci(n):", "--max-tokens", "128"],
    "long_prompt": [(ROOT / "src" / "unmask" / "engine" / "speculative.py").read_text()[:6000], "--max-tokens", "16"],
}


def policy_env(policy: str, threads: int) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.split(":", 1)[1]
    elif policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def one(policy: str, args: list[str], threads: int) -> float:
    env = policy_env(policy, threads)
    cmd = [sys.executable, "-m", "unmask.cli", "generate", "--stats", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    found = re.findall(r"([\d.]+) tokens/s", p.stdout + p.stderr)
    if p.returncode or not found:
        raise SystemExit(f"generate {args[1:]} failed: {(p.stdout + p.stderr)[-800:]}")
    return float(found[-1])


def serve_once(policy: str, threads: int, concurrency: int) -> float:
    """Output tokens/s of `unmask loadtest` (64 requests of 64 tokens, EOS ignored) against a fresh `unmask serve`
    started under `policy`; the client runs as the CLI sets it up (its own process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "unmask.cli", "serve", "--port", str(port)], cwd=ROOT,
                              env=policy_env(policy, threads), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "load.json"
            subprocess.run([sys.executable, "-m", "unmask.cli", "loadtest", "--url", f"http://127.0.0.1:{port}",
                            "--concurrency", str(concurrency), "-n", "64", "--output-len", "64", "--ignore-eos",
                            "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=900)
            return float(json.loads(out.read_text())["points"][0]["output_throughput"])
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-concurrency", type=lambda v: [int(x) for x in v.split(",") if x], default=[1, 4],
                    help="streams of the serve cases, comma-separated (empty: no serve case)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="unset, PASSIVE, ACTIVE or spin:N (GOMP_SPINCOUNT=N), comma-separated; ratios are to the first")
    ap.add_argument("--burners", type=int, default=0,
                    help="busy-loop processes at the bench's own priority while it runs: a shared machine on demand")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    policies = a.policies.split(",")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.burners)]
    doc = {"command": " ".join(sys.argv), "threads": a.threads, "burners": a.burners,
           "load_average_start": os.getloadavg(), "cases": {}}
    def measure(name: str, fn) -> None:
        """fn(policy) -> tokens/s, interleaved over the rounds (benchlib's rotation); per-round ratios."""
        def run(policy: str, r: int) -> float:
            tps = fn(policy)
            print(f"{name} round {r} {policy:8} {tps:7.1f} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
            return tps

        runs = interleave(policies, a.rounds, run)
        ratios = {p: ratio_summary(runs[p], runs[policies[0]]) for p in policies[1:]}
        doc["cases"][name] = {"tokens_per_s": runs, "median": {p: summary(v)["median"] for p, v in runs.items()},
                              f"over_{policies[0]}": ratios}
        print(f"{name}: " + ", ".join(f"{p} / {policies[0]} x{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"
                                      for p, r in ratios.items()), flush=True)

    try:
        for case, args in CASES.items():
            measure(case, lambda policy, args=args: one(policy, args, a.threads))
        for concurrency in a.serve_concurrency:
            measure(f"serve_{concurrency}", lambda policy, c=concurrency: serve_once(policy, a.threads, c))
    finally:
        for b in burners:
            b.kill()
    doc["load_average_end"] = os.getloadavg()
    if a.json:
        write_json(a.json, doc)


if __name__ == "__main__":
    main()
