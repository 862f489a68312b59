"""A two-node Ray cluster on this machine (a head and a worker started with `ray start`, loopback only, one CPU
each): `unmask batch --ray` spreads its lines over engines on both nodes, writes what `unmask batch` writes, and
resumes a partial output (from the same requests as Parquet); `unmask serve --ray --address` joins the cluster and
answers the openai client (on a port of its choosing, under a root path), its replicas on both nodes sharing one
store in Postgres (--database-url). Without Ray, `--ray` says in one line how to install it.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray", reason="Ray is optional: pip install 'unmask[ray]'")
openai = pytest.importorskip("openai")

from pg_server import postgres  # noqa: E402,F401 - the session's Postgres server
from unmask.batch.offline import run as run_offline  # noqa: E402

BIN = Path(sys.executable).parent
# the cluster runs with token authentication, as a shared one should: `ray start` then needs a token (it does not
# make one), and every client must present it. A token of the test's own, so a fresh machine (no
# ~/.ray/auth_token) runs the same as one where Ray was used before.
ENV = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32))
HINT = "error: Ray is not installed; --ray needs it: pip install 'unmask[ray]'"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0.0, **body}}


LINES = [chat(f"c{i}", f"Item {i}.") for i in range(6)] + [
    chat("empty", "x", messages=[]),
    {"custom_id": "cmp", "method": "POST", "url": "/v1/completions", "body": {"prompt": "def f(x):", "max_tokens": 4}},
    chat("other-model", "x", model="gpt-4o"),
]


def start(args: list[str]) -> subprocess.Popen:
    """`ray start ... --block` in a session of its own: stopping it stops exactly the processes it started."""
    return subprocess.Popen([str(BIN / "ray"), "start", *args, "--block"], start_new_session=True, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(*processes: subprocess.Popen) -> None:
    """SIGTERM to each one's session at once (they stop in parallel), SIGKILL to those still there after 3 s."""
    left = list(processes)
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        for process in left:
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        for process in list(left):
            try:
                process.wait(max(0.0, deadline - time.time()))
                left.remove(process)
            except subprocess.TimeoutExpired:
                pass
        if not left:
            return


@pytest.fixture(scope="module")
def address():
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    head = start(["--head", "--port", str(port), "--include-dashboard", "false", *common])
    worker = None
    try:
        wait_nodes = ("import ray, sys, time; ray.init(address=sys.argv[1], logging_level='ERROR'); d = time.time() + 60\n"
                      "while len([n for n in ray.nodes() if n['Alive']]) < 2 and time.time() < d: time.sleep(0.5)\n"
                      "sys.exit(len([n for n in ray.nodes() if n['Alive']]) != 2)")
        deadline = time.time() + 60
        while time.time() < deadline:   # the head's GCS must answer before the worker joins
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.3)
        worker = start(["--address", address, *common])
        assert subprocess.run([sys.executable, "-c", wait_nodes, address], timeout=90, env=ENV).returncode == 0
        yield address
    finally:
        stop(*[p for p in (worker, head) if p is not None])
        current = Path("/tmp/ray/ray_current_cluster")   # what `ray stop` would clear: a later ray.init() must not
        if current.exists() and current.read_text().strip().endswith(f":{port}"):   # try to join this cluster
            current.unlink()


def interrupt(server: subprocess.Popen) -> int | None:
    """Ctrl-C, as a user stops `unmask serve`: its exit status, or None if it had to be killed after 60 s."""
    server.send_signal(signal.SIGINT)
    try:
        return server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        return None


def unmask(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "unmask"), *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def without_ids(record: dict) -> dict:
    body = dict(record["response"]["body"] or {})
    for k in ("id", "created"):
        body.pop(k, None)
    error = record["error"]
    return {"custom_id": record["custom_id"], "status": record["response"]["status_code"], "body": body,
            "error": error}


def test_batch_runs_on_both_nodes_as_unmask_batch_writes_and_resumes_from_parquet(address, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LINES))
    done = unmask("batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--ray", "--address", address,
                  "--workers", "2", "--num-cpus", "1", "--max-num-seqs", "2", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "7 succeeded, 2 failed, 0 already in" in done.stderr and "on 2 node(s)" in done.stderr, done.stderr[-2000:]
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in out] == [x["custom_id"] for x in LINES]
    # the same records as the offline runner in this process: answers (greedy) and per-line errors
    run_offline(tmp_path / "in.jsonl", tmp_path / "local.jsonl", max_num_seqs=2, progress=False)
    local = [json.loads(x) for x in (tmp_path / "local.jsonl").read_text().splitlines()]
    assert [without_ids(r) for r in out] == [without_ids(r) for r in local]
    assert out[6]["error"]["message"] == "messages must not be empty" and out[8]["response"]["status_code"] == 404

    # a run killed after 3 lines, mid-write; resumed from the same requests as Parquet (bodies as JSON text)
    full = (tmp_path / "out.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "out.jsonl").write_text("".join(full[:3]) + full[3][:30])
    table = pa.table({k: [x[k] if k != "body" else json.dumps(x["body"]) for x in LINES]
                      for k in ("custom_id", "method", "url", "body")})
    pq.write_table(table, tmp_path / "in.parquet")
    again = unmask("batch", str(tmp_path / "in.parquet"), str(tmp_path / "out.jsonl"), "--ray", "--address", address,
                   "--workers", "1", "--num-cpus", "1", "--max-num-seqs", "4", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "4 succeeded, 2 failed, 3 already in" in again.stderr, again.stderr[-2000:]
    resumed = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [without_ids(r) for r in resumed] == [without_ids(r) for r in local]


def test_serve_joins_the_cluster_and_answers_the_openai_client(address, tmp_path, postgres):   # noqa: F811
    from test_store_postgres import new_database

    # --port 0: the front listens on a free port and prints it; --root-path as behind a proxy that strips /u;
    # a replica of 1 CPU on each node (each has one), sharing one store in Postgres (--database-url)
    server = subprocess.Popen([str(BIN / "unmask"), "serve", "--ray", "--address", address, "--port", "0",
                               "--root-path", "/u", "--replicas", "2", "--num-cpus", "1", "--embedding-model", "off",
                               "--max-num-seqs", "4", "--data-dir", str(tmp_path / "data"),
                               "--database-url", new_database(postgres),
                               "--static-step", "--kv-pool-tokens", "256"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        log = []
        reader = threading.Thread(target=lambda: log.extend(server.stderr), daemon=True)
        reader.start()
        deadline = time.time() + 150
        while not (ready := [x for x in log if "unmask: serving unmask-tiny on" in x]):   # printed once listening
            assert server.poll() is None and time.time() < deadline, "".join(log)[-3000:]
            time.sleep(0.5)
        base = re.search(r"on (http://127\.0\.0\.1:\d+) with 2 engine replica\(s\) on Ray at ", ready[0]).group(1)
        assert not base.endswith(":0")
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == ["unmask-tiny"]
        keys, k = {}, 0   # replica -> a prompt_cache_key that it answers
        while len(keys) < 2 and time.time() < deadline:   # the front's router learns of both replicas
            raw = client.chat.completions.with_raw_response.create(
                model="unmask-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, prompt_cache_key=str(k))
            assert raw.parse().choices[0].message.content
            keys.setdefault(raw.headers["x-unmask-replica"], str(k))
            k += 1
        assert len(keys) == 2
        # --static-step --kv-pool-tokens reached both replicas' engines: a request over the pool is refused by its
        # size (a threshold request: the built-in model's default policy, speculative, does not use the pool)
        for replica, key in keys.items():
            r = httpx.post(base + "/v1/chat/completions", timeout=30, json={
                "model": "unmask-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400,
                "policy": "threshold", "prompt_cache_key": key})
            assert r.status_code == 400 and r.headers["x-unmask-replica"] == replica, r.text
            assert "needs" in r.json()["error"]["message"] and "preallocated KV pool, which holds 256" in \
                r.json()["error"]["message"], r.text
        # the replicas, one on each node, share the store in Postgres (batches are claimed row by row): a file
        # uploaded through the gateway is read through either replica (the state routes take the shortest queue)
        batch_in = "".join(json.dumps(chat(f"b{i}", f"Item {i}.", model="unmask-tiny")) + "\n" for i in range(3)).encode()
        file_id = client.files.create(file=("in.jsonl", batch_in), purpose="batch").id
        def read(_):
            r = httpx.get(f"{base}/v1/files/{file_id}/content", timeout=30)
            assert r.status_code == 200 and r.content == batch_in, r.text
            return r.headers["x-unmask-replica"]

        readers = set()
        with ThreadPoolExecutor(8) as pool:   # 8 at once: the shortest queue sends some to each replica
            for _ in range(10):
                readers.update(pool.map(read, range(8)))
                if len(readers) == 2:
                    break
        assert readers == set(keys), readers
        batches = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id for _ in range(2)]
        for batch_id in batches:
            while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed"):
                assert time.time() < deadline + 60, batch
                time.sleep(0.5)
            assert batch.status == "completed" and batch.request_counts.completed == 3, batch
            output = client.files.content(batch.output_file_id).read().decode().splitlines()
            assert [json.loads(x)["custom_id"] for x in output] == ["b0", "b1", "b2"]
        assert not (tmp_path / "data").exists() or not list((tmp_path / "data").iterdir())   # nothing on disk
        # the replicas' app sees the root path, as `unmask serve --root-path` does: the OpenAPI document names it
        assert httpx.get(base + "/openapi.json", timeout=30).json()["servers"] == [{"url": "/u"}]
        assert httpx.get(base + "/health", timeout=30).json() == {"status": "ok"}
    finally:
        rc = interrupt(server)
    assert rc == 0, "".join(log)[-3000:]
    # taken down on the gateway's loop (front.py): no error from its Serve router, no traceback
    assert not [x for x in log if "ERROR" in x or "Traceback" in x], "".join(log)[-3000:]


def test_serve_on_a_cluster_of_its_own_stops_on_ctrl_c_without_errors(tmp_path):
    """The default path: `unmask serve --ray` starts a local cluster, and Ctrl-C takes the replicas, Serve and the
    cluster down on the gateway's loop (front.py); it used to end in a traceback (its Serve router shut down after
    that loop had closed) and an ERROR from the router's update client."""
    server = subprocess.Popen([str(BIN / "unmask"), "serve", "--ray", "--port", "0", "--num-cpus", "1",
                               "--embedding-model", "off", "--data-dir", str(tmp_path / "data")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    log = []
    reader = threading.Thread(target=lambda: log.extend(server.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 150
        while not (ready := [x for x in log if "unmask: serving unmask-tiny on" in x]):
            assert server.poll() is None and time.time() < deadline, "".join(log)[-3000:]
            time.sleep(0.5)
        base = re.search(r"on (http://127\.0\.0\.1:\d+) with 1 engine replica\(s\) on Ray \(a local cluster\)",
                         ready[0]).group(1)
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=30, json={
                "model": "unmask-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "stream": True}) as r:
            assert r.status_code == 200 and "data: [DONE]" in r.read().decode()
    finally:
        rc = interrupt(server)
        reader.join(5)
    assert rc == 0, "".join(log)[-3000:]
    assert not [x for x in log if "ERROR" in x or "Traceback" in x], "".join(log)[-3000:]


@pytest.mark.parametrize("command", [["serve", "--ray"], ["batch", "IN", "OUT", "--ray"]])
def test_without_ray_the_flag_says_how_to_install_it(command, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from unmask.cli import app

    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` fails, as where it is not installed
    (tmp_path / "in.jsonl").write_text(json.dumps(LINES[0]) + "\n")
    command = [str(tmp_path / "in.jsonl") if c == "IN" else str(tmp_path / "out.jsonl") if c == "OUT" else c
               for c in command]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 1 and result.output.strip() == HINT, result.output
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("command, message", [
    (["serve", "--ray", "--autoscale", "3,1"], "error: --autoscale takes MIN,MAX replicas with 0 <= MIN <= MAX and "
                                               "MAX >= 1, got '3,1'"),
    (["batch", "IN", "OUT", "--ray", "--address", "127.0.0.1:1"],
     "error: no Ray cluster answers at 127.0.0.1:1 (Connection refused); start its head with `ray start --head` or "
     "pass another --address"),
])
def test_bad_cluster_flags_are_one_line_errors(command, message, tmp_path):
    from typer.testing import CliRunner

    from unmask.cli import app

    (tmp_path / "in.jsonl").write_text(json.dumps(LINES[0]) + "\n")
    command = [str(tmp_path / "in.jsonl") if c == "IN" else str(tmp_path / "out.jsonl") if c == "OUT" else c
               for c in command]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 1 and result.output.strip() == message, result.output
    assert not (tmp_path / "out.jsonl").exists()
