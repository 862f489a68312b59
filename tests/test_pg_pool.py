"""The chunk index's bounded pool of Postgres connections (unmask.store.pg_pool, used by retrieval/pg_index.py), on
the real PostgreSQL + pgvector server of tests/pg_server.py: concurrent searches from threads that come and go hold
at most the pool's connections, as the server counts them (pg_stat_activity), and find what one search alone
finds; connections the server dropped cost one 503-worthy error, and closing the index closes them all."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pg_server import new_database, postgres  # noqa: F401 - the session's Postgres server
from unmask.retrieval.index import NewChunk
from unmask.retrieval.pg_index import PostgresIndex
from unmask.store import StoreUnavailable

DIM, POOL = 8, 3
TOPICS = ["kiln fuse drawer", "tomato garden water", "bicycle chain grease", "violin string rosin",
          "harbour ferry timetable", "oven bread flour"]


def held(monitor) -> int:
    """Connections to the monitor's database, as the server counts them (the monitor's own left out; one
    monitor connection throughout, since a closed one stays listed for a moment)."""
    return monitor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND "
                           "pid != pg_backend_pid()").fetchone()[0]


@pytest.fixture
def index(postgres):  # noqa: F811 - the fixture imported above
    import psycopg

    url = new_database(postgres)
    idx = PostgresIndex(url, DIM, pool_size=POOL)
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(len(TOPICS), DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for i, (topic, v) in enumerate(zip(TOPICS, vectors)):
        idx.add("vs_a" if i % 2 else "vs_b", f"file-{i}", [NewChunk(0, f"Notes on the {topic}.", v)])
    with psycopg.connect(url, autocommit=True) as monitor:
        yield idx, monitor, vectors
    idx.close()


def search(idx, vectors, i: int) -> list[tuple[str, str]]:
    hits = idx.search(["vs_a", "vs_b"], TOPICS[i], vectors[i], 3)
    return [(h.file_id, h.text) for h in hits]


def test_concurrent_searches_use_at_most_the_pool_and_find_the_right_chunks(index):
    idx, monitor, vectors = index
    alone = {i: search(idx, vectors, i) for i in range(len(TOPICS))}
    assert all(alone[i][0] == (f"file-{i}", f"Notes on the {TOPICS[i]}.") for i in alone), alone

    peak, done = [0], threading.Event()

    def watch() -> None:   # the server's count of this database's connections, sampled while the searches run
        while not done.is_set():
            peak[0] = max(peak[0], held(monitor))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(3):   # a new set of 16 threads each round: threads come and go, connections stay bounded
            with ThreadPoolExecutor(16) as pool:
                jobs = [i % len(TOPICS) for i in range(48)]
                assert list(pool.map(lambda i: search(idx, vectors, i), jobs)) == [alone[i] for i in jobs]
    finally:
        done.set()
        watcher.join()
    assert 1 <= peak[0] <= POOL, peak[0]
    assert held(monitor) <= POOL and idx.pool.idle <= POOL   # the 48 threads are gone; no connection left per thread
    idx.close()
    deadline = time.monotonic() + 10
    while held(monitor):   # the server sees the closed connections go (asynchronously)
        assert time.monotonic() < deadline, held(monitor)
        time.sleep(0.05)
    with pytest.raises(StoreUnavailable, match="closed"):
        search(idx, vectors, 0)


def test_connections_the_server_dropped_cost_one_error_then_searches_reconnect(index):
    idx, monitor, vectors = index
    with ThreadPoolExecutor(POOL) as pool:   # fill the pool with idle connections
        list(pool.map(lambda i: search(idx, vectors, i), range(2 * POOL)))
    assert idx.pool.idle >= 1
    monitor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid != pg_backend_pid()")   # as a database restart does to them
    deadline = time.monotonic() + 10
    while held(monitor):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(StoreUnavailable, match="did not answer"):   # the routes' 503
        search(idx, vectors, 0)
    assert idx.pool.idle == 0   # the other dropped connections were let go with it
    assert search(idx, vectors, 1)[0][0] == "file-1"


@pytest.mark.parametrize("which", ["database", "index"])
def test_a_server_that_never_answers_is_given_up_on_after_the_connect_timeout(monkeypatch, which):
    """A host that accepts and then says nothing (a hung server, a half-open proxy) used to hold connect() as long
    as the OS would: now the store's connect timeout ends it with a clear StoreUnavailable."""
    import socket

    import unmask.store.pg as pg
    from unmask.store.pg import PostgresDatabase

    monkeypatch.setattr(pg, "CONNECT_TIMEOUT_S", 2)  # libpq's smallest
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    url = f"postgresql://u:p@127.0.0.1:{port}/x"
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable, match=f"cannot connect to the (database|vector store) 127.0.0.1:{port}"):
            PostgresDatabase(url) if which == "database" else PostgresIndex(url, DIM, pool_size=1)
    finally:
        silent.close()
    assert time.monotonic() - t0 < 15
    assert pg.connect_options(url + "?connect_timeout=30") == {}  # the URL's own wins
