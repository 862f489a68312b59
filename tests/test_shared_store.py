"""Several workers on one store: claims on batches and on files to ingest (unmask.store.claims), so that two
server processes on one data directory (or the replicas of `unmask serve --ray` on one machine) run each batch and
ingest each file exactly once. The ingestion race runs on both chunk backends: SQLite, and a real PostgreSQL +
pgvector server (tests/pg_server.py)."""
from __future__ import annotations

import io
import subprocess
import threading
import time
import uuid
from collections import Counter

import pytest

from pg_server import postgres  # noqa: F401 - the session's Postgres server
from store_server import start_app
from test_batches import chat_line, records, upload, wait_for
from test_retrieval_index import encoder  # noqa: F401 - the default embedder, loaded once per module


# ---------------------------------------------------------------------------------------- the claims themselves
def dead_local_owner() -> str:
    """An owner name of this machine whose process has exited (and been reaped)."""
    from unmask.store.claims import process_owner

    proc = subprocess.Popen(["true"])
    proc.wait()
    host, ns, _, token = process_owner().split("|")
    return f"{host}|{ns}|{proc.pid}|{token}"


def test_a_claim_is_taken_once_renewed_fenced_and_freed(tmp_path):
    from unmask.batch.jobs import BatchJobs
    from unmask.store import open_store
    from unmask.store.claims import LEASE_S, ClaimLost

    store = open_store(tmp_path)
    jobs = BatchJobs(store.db)
    ids = [jobs.create("file-x", "/v1/chat/completions", "24h", None, None)["id"] for _ in range(3)]
    a, b = jobs.claims(), jobs.claims()
    assert a.owner != b.owner
    assert a.claim(ids[0]) and not b.claim(ids[0]) and a.claim(ids[0])   # held: only its owner claims it again
    assert b.claim(ids[1]) and a.holds(ids[0]) and not a.holds(ids[1])
    # state changes are fenced on the claim
    assert jobs.update(ids[0], "in_progress", owner=a.owner)["status"] == "in_progress"
    with pytest.raises(ClaimLost, match=f"batch {ids[0]} is no longer claimed by this process"):
        jobs.update(ids[0], "failed", owner=b.owner)
    assert jobs.status(ids[0]) == ("in_progress", a.owner)
    # a renewal extends every lease of its owner; a lease that ran out may be taken
    before = time.time()
    assert a.renew() == 1
    lease = store.db.conn.execute("SELECT lease_until FROM batches WHERE id = ?", (ids[0],)).fetchone()[0]
    assert before + LEASE_S <= lease <= time.time() + LEASE_S
    store.db.conn.execute("UPDATE batches SET lease_until = ? WHERE id = ?", (time.time() - 1, ids[0]))
    assert b.claim(ids[0]) and not a.holds(ids[0])
    with pytest.raises(ClaimLost):
        jobs.update(ids[0], "finalizing", owner=a.owner)
    # released rows are free again; a dead process of this machine holds nothing, one elsewhere keeps its lease
    b.release(ids[0])
    assert a.claim(ids[0])
    dead, remote = dead_local_owner(), "another-host|pid:[1]|1|abcd"
    store.db.conn.execute("UPDATE batches SET owner = ?, lease_until = ? WHERE id = ?", (dead, time.time() + 600, ids[1]))
    store.db.conn.execute("UPDATE batches SET owner = ?, lease_until = ? WHERE id = ?", (remote, time.time() + 600, ids[2]))
    assert not a.claim(ids[1]) and a.sweep() == 1 and a.claim(ids[1])
    assert not a.claim(ids[2]) and jobs.status(ids[2]) == ("validating", remote)
    a.release_all()
    assert [jobs.status(i)[1] for i in ids] == [None, None, remote]
    store.close()


def test_an_older_data_directory_gains_the_claim_columns(tmp_path):
    """A database written before claims (schema version 1) is migrated, its batches kept."""
    import sqlite3

    from unmask.store import open_store
    from unmask.store.schema import MIGRATIONS

    conn = sqlite3.connect(tmp_path / "unmask.db", isolation_level=None)
    for statement in filter(str.strip, MIGRATIONS[0].split(";")):
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO batches (id, status, object) VALUES ('batch_old', 'in_progress', '{}')")
    conn.close()
    store = open_store(tmp_path)
    row = store.db.conn.execute("SELECT id, status, owner, lease_until FROM batches").fetchone()
    assert tuple(row) == ("batch_old", "in_progress", None, None)
    assert store.db.conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    store.close()


# ---------------------------------------------------------------------------------------- two servers, one store
@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """Two `unmask serve` apps (each its own batch runner) on one data directory."""
    data = tmp_path_factory.mktemp("shared")
    apps = [start_app(data, max_num_seqs=4, embedding_model="off") for _ in range(2)]
    try:
        for app in apps:
            app.wait_model()
        yield apps
    finally:
        for app in apps:
            app.stop()


def record_engine_requests(app, monkeypatch, seen: list) -> None:
    engine = app.app.state.serving.engine.engine
    original = engine.add_request

    def recording(prompt_ids, params=None, request_id=None):
        seen.append(tuple(prompt_ids))
        return original(prompt_ids, params, request_id)

    monkeypatch.setattr(engine, "add_request", recording)


def test_two_servers_on_one_store_run_each_batch_once(two_servers, monkeypatch):
    a, b = two_servers
    seen = [[], []]
    for app, log in zip(two_servers, seen):
        record_engine_requests(app, monkeypatch, log)
    clients = [a.client(), b.client()]
    n_batches, n_lines = 6, 2
    batch_ids = []
    for i in range(n_batches):   # created through both servers, so both runners are woken at once
        client = clients[i % 2]
        lines = [chat_line(f"b{i}-l{j}", f"Batch {i}, item {j}.") for j in range(n_lines)]
        batch_ids.append(client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    for i, batch_id in enumerate(batch_ids):
        done = wait_for(clients[0], batch_id, ("completed", "failed"), timeout=180)
        assert done.status == "completed" and done.request_counts.model_dump() == {
            "total": n_lines, "completed": n_lines, "failed": 0}, done
        assert [r["custom_id"] for r in records(clients[1], done.output_file_id)] == [f"b{i}-l{j}"
                                                                                      for j in range(n_lines)]
    # each line reached an engine once, and each batch wrote one output file
    engine_requests = seen[0] + seen[1]
    assert len(engine_requests) == n_batches * n_lines and len(set(engine_requests)) == n_batches * n_lines
    outputs = [f.filename for f in clients[0].files.list(purpose="batch_output") if f.filename.startswith(
        tuple(batch_ids))]
    assert sorted(outputs) == sorted(f"{b}_output.jsonl" for b in batch_ids)
    assert len(seen[0]) > 0 and len(seen[1]) > 0, "one runner did all the work: the race was not exercised"


def test_a_cancel_through_the_other_server_stops_the_running_batch(two_servers):
    from unmask.batch.jobs import BatchJobs

    apps = list(two_servers)
    client = apps[0].client()
    batch = client.batches.create(input_file_id=upload(client, [chat_line(f"c{i}", f"Item {i}.", max_tokens=32)
                                                                for i in range(40)]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    jobs = BatchJobs(apps[0].app.state.store.get().db)
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    owner = jobs.status(batch.id)[1]
    running = next(app for app in apps if app.app.state.batches.owner == owner)
    other = next(app for app in apps if app is not running)
    other.client().batches.cancel(batch.id)
    done = wait_for(client, batch.id, ("cancelled", "completed"), timeout=60)
    assert done.status == "cancelled" and done.request_counts.completed < 40, done
    errors = records(client, done.error_file_id)
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"}
    assert done.request_counts.completed + len(errors) == 40


# ---------------------------------------------------------------------------------------- ingestion workers
def vector_store_url(backend: str, request) -> str | None:
    if backend == "sqlite":
        return None
    import psycopg

    server = request.getfixturevalue("postgres")
    db = "claims_" + uuid.uuid4().hex[:8]
    with psycopg.connect(server.url, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {db}")
    return server.url.rsplit("/", 1)[0] + "/" + db


def open_worker(root, encoder, url, counts: Counter):
    """One process's view of the data directory: its file store and vector stores, counting its index writes."""
    from unmask.retrieval.vector_stores import VectorStores
    from unmask.store import open_store

    store = open_store(root)
    service = VectorStores.open(root, encoder, store.files, url)
    add = service.index.add

    def counted(store_id, file_id, chunks):
        counts[file_id] += 1
        return add(store_id, file_id, chunks)

    service.index.add = counted
    return store, service


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_two_ingestion_workers_on_one_store_ingest_each_file_once(backend, tmp_path, encoder, request):
    from unmask.retrieval.chunking import ChunkingStrategy
    from unmask.retrieval.vector_stores import Attach

    url = vector_store_url(backend, request)
    counts = [Counter(), Counter()]
    workers = [open_worker(tmp_path, encoder, url, c) for c in counts]
    (store_a, vs_a), (_, vs_b) = workers
    n = 24
    files = [store_a.files.create(io.BytesIO(f"Note {i}: the part numbered {i * 13} is kept in drawer {i}.".encode()),
                                  f"note{i}.txt", "assistants") for i in range(n)]
    created = vs_a.create_store("shared", {}, None, [Attach(f.id, f.filename, {}, ChunkingStrategy(100, 0))
                                                     for f in files])
    assert created["file_counts"]["in_progress"] == n
    try:
        for _, service in workers:   # both start on a full queue, woken together: they race for every row
            service.start()
        deadline = time.monotonic() + 120
        while (state := vs_b.store(created["id"]))["file_counts"]["completed"] < n:
            assert time.monotonic() < deadline and state["file_counts"]["failed"] == 0, state
            time.sleep(0.05)
        ingested = counts[0] + counts[1]
        assert sorted(ingested) == sorted(f.id for f in files) and set(ingested.values()) == {1}
        assert counts[0] and counts[1], "one worker did all the work: the race was not exercised"
        assert vs_a.index.count(created["id"]) == n
        if backend == "postgres":   # every chunk row ever written is still there: none was replaced by a rerun
            table = vs_a.index.table
            with vs_a.index.pool.connection() as conn:
                inserted = conn.execute(f"SELECT last_value FROM {table}_id_seq").fetchone()[0]
            assert inserted == n
        hit = vs_b.search([created["id"]], "drawer 17", 1, mode="keyword")[0]
        assert hit[0].text.startswith("Note 17:")
        assert vs_a.db.execute("SELECT count(*) FROM vector_store_files WHERE owner IS NOT NULL").fetchone()[0] == 0
    finally:
        for store, service in workers:
            service.stop()
            store.close()


def test_a_file_held_by_a_crashed_local_worker_is_ingested_at_once(tmp_path, encoder):
    """A row left claimed by a process of this machine that has exited is taken without waiting for its lease."""
    from unmask.retrieval.chunking import ChunkingStrategy
    from unmask.retrieval.vector_stores import Attach

    counts = Counter()
    store, service = open_worker(tmp_path, encoder, None, counts)
    f = store.files.create(io.BytesIO(b"The crashed worker held this file."), "held.txt", "assistants")
    created = service.create_store("held", {}, None, [Attach(f.id, f.filename, {}, ChunkingStrategy(100, 0))])
    service.db.execute("UPDATE vector_store_files SET owner = ?, lease_until = ?", (dead_local_owner(),
                                                                                    time.time() + 600))
    started = time.monotonic()
    service.start()
    try:
        while service.store(created["id"])["file_counts"]["completed"] < 1:
            assert time.monotonic() - started < 30
            time.sleep(0.05)
        assert counts == Counter({f.id: 1})
    finally:
        service.stop()
        store.close()


def test_the_heartbeat_renews_while_the_worker_is_busy():
    from unmask.store.claims import Heartbeat

    renewed = threading.Event()
    calls = []
    beat = Heartbeat(lambda: (calls.append(time.monotonic()), len(calls) >= 3 and renewed.set()), "test-beat",
                     every=0.05).start()
    try:
        assert renewed.wait(10)
    finally:
        beat.stop()
    assert len(calls) >= 3
