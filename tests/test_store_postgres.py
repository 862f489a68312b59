"""One store for servers on several machines: two `unmask serve` apps with different data directories and one
Postgres database (`--database-url`, unmask.store.pg) see the same files (their bytes too), vector stores and
batches, on the real PostgreSQL + pgvector server of tests/pg_server.py. Neither data directory holds any of it."""
from __future__ import annotations

import io
import shutil
import time

import openai
import pytest

from pg_server import new_database, new_postgres, postgres  # noqa: F401 - postgres: the session's server
from store_server import start_app
from test_batches import chat_line, records, upload, wait_for
from test_shared_store import record_engine_requests


@pytest.fixture(scope="module")
def two_machines(postgres, tmp_path_factory):   # noqa: F811 - the fixture imported above
    """Two apps as on two machines: each its own data directory, both on one database."""
    url = new_database(postgres)
    dirs = [tmp_path_factory.mktemp(f"node{i}") for i in range(2)]
    apps = [start_app(d, max_num_seqs=4, database_url=url) for d in dirs]
    try:
        for app in apps:
            app.wait_model()
            wait_vector_stores(app)
        yield apps, dirs
    finally:
        for app in apps:
            app.stop()


def wait_vector_stores(app, timeout: float = 120) -> None:
    """Until the app's embedding model has loaded and its vector stores opened (on the database)."""
    state, deadline = app.app.state.retrieval, time.monotonic() + timeout
    while state.vector_stores is None:
        assert state.load_error is None and time.monotonic() < deadline, state.load_error
        time.sleep(0.05)


def wait_ingested(client: openai.OpenAI, store_id: str, n: int, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (store := client.vector_stores.retrieve(store_id)).file_counts.completed < n:
        assert time.monotonic() < deadline and store.file_counts.failed == 0, store
        time.sleep(0.1)
    return store


def test_files_uploaded_through_one_server_are_read_and_deleted_through_the_other(two_machines):
    (a, b), _ = two_machines
    ca, cb = a.client(), b.client()
    data = bytes(range(256)) * 9000   # 2.3 MB: three 1 MiB chunks in the database
    up = ca.files.create(file=("blob.bin", io.BytesIO(data)), purpose="user_data")
    got = cb.files.retrieve(up.id)
    assert (got.filename, got.bytes, got.purpose) == ("blob.bin", len(data), "user_data")
    assert cb.files.content(up.id).read() == data
    assert up.id in [f.id for f in cb.files.list(purpose="user_data")]
    assert cb.files.delete(up.id).deleted
    with pytest.raises(openai.NotFoundError, match=f"no file with id '{up.id}'"):
        ca.files.content(up.id)
    assert up.id not in [f.id for f in ca.files.list()]


def test_a_vector_store_made_through_one_server_is_searched_through_the_other(two_machines):
    (a, b), _ = two_machines
    ca, cb = a.client(), b.client()
    notes = {"drawer.txt": "The spare fuse for the kiln is kept in the third drawer of the blue cabinet.",
             "garden.txt": "Tomatoes in the north bed need water every second morning in July."}
    ids = {name: ca.files.create(file=(name, io.BytesIO(text.encode())), purpose="assistants").id
           for name, text in notes.items()}
    store = cb.vector_stores.create(name="shared", file_ids=list(ids.values()))
    assert wait_ingested(ca, store.id, 2).file_counts.total == 2
    hits = ca.vector_stores.search(vector_store_id=store.id, query="where is the spare fuse kept?").data
    assert hits[0].file_id == ids["drawer.txt"] and "third drawer" in hits[0].content[0].text
    assert {f.id for f in cb.vector_stores.files.list(vector_store_id=store.id)} == set(ids.values())


def test_a_batch_created_through_one_server_runs_once_and_is_read_through_the_other(two_machines, monkeypatch):
    (a, b), dirs = two_machines
    seen = [[], []]
    for app, log in zip((a, b), seen):
        record_engine_requests(app, monkeypatch, log)
    ca, cb = a.client(), b.client()
    n = 4
    input_id = upload(ca, [chat_line(f"line-{i}", f"Item {i}.") for i in range(n)])
    batch = cb.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(ca, batch.id, ("completed", "failed"), timeout=180)
    assert done.status == "completed" and done.request_counts.model_dump() == {"total": n, "completed": n,
                                                                               "failed": 0}, done
    assert [r["custom_id"] for r in records(cb, done.output_file_id)] == [f"line-{i}" for i in range(n)]
    assert len(seen[0]) + len(seen[1]) == n   # each line reached one engine once
    # the state lives in Postgres only: neither machine's data directory holds a database or a file's bytes
    assert [sorted(p.name for p in d.iterdir()) for d in dirs] == [[], []]


def test_a_server_holds_a_few_connections_not_one_per_thread(two_machines):
    """40 requests at once through each server (FastAPI runs them on up to 40 threads): each statement goes
    through the server's one shared connection, each download through one of its own that is closed after it."""
    import psycopg
    from concurrent.futures import ThreadPoolExecutor

    (a, b), _ = two_machines
    data = b"0123456789" * 1000
    file_id = a.client().files.create(file=("c.txt", io.BytesIO(data)), purpose="user_data").id
    clients = [a.client(), b.client()]

    def read(i: int) -> bytes:
        client = clients[i % 2]
        assert client.files.retrieve(file_id).bytes == len(data)
        return client.files.content(file_id).read()

    with ThreadPoolExecutor(80) as pool:
        assert list(pool.map(read, range(80))) == [data] * 80
    url = a.app.state.store.get().db.url
    with psycopg.connect(url) as c:
        held = c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND "
                         "pid != pg_backend_pid()").fetchone()[0]
    assert held <= 12, held   # 4 when this test runs alone (two shared, two of the chunk index)



def test_a_database_that_does_not_answer_is_a_503_and_the_batch_runner_keeps_waiting():
    from fastapi.testclient import TestClient

    from store_server import free_port
    from unmask.defaults import default_model_path
    from unmask.server.app import ServerArgs, create_app

    down = f"postgresql://unmask@127.0.0.1:{free_port()}/store"   # nothing listens there
    app = create_app(ServerArgs(model=default_model_path(), served_model_name="m", embedding_model="off",
                                database_url=down))
    with TestClient(app) as client:
        r = client.get("/v1/files")
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert r.json()["error"] == {"message": "the server's database is unavailable; retry shortly",
                                     "type": "service_unavailable_error", "param": None, "code": "store_unavailable"}
        r = client.post("/v1/files", files={"file": ("a.txt", b"x")}, data={"purpose": "assistants"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
        deadline = time.monotonic() + 120
        while app.state.serving is None:   # the runner starts polling the store once the model is loaded
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(2.5)   # two of its polls, each refused by the database
        assert not app.state.batches._task.done()


def test_vector_stores_wait_for_a_database_that_is_down_at_startup_and_open_once_it_answers(tmp_path):
    """The server comes up on a Postgres that is not running yet: the vector store routes answer 503
    store_unavailable (as when the database goes away later) while the loader retries; once Postgres starts on
    that port, they work without a restart."""
    from fastapi.testclient import TestClient

    from unmask.defaults import default_model_path
    from unmask.server.app import ServerArgs, create_app

    server = new_postgres()   # its port chosen; nothing listens there yet
    app = create_app(ServerArgs(model=default_model_path(), served_model_name="m", data_dir=tmp_path,
                                database_url=server.url))
    try:
        with TestClient(app) as client:
            state, deadline = app.state.retrieval, time.monotonic() + 120
            while state.store_error is None:   # the embedding model loaded, the database refused
                assert state.load_error is None and time.monotonic() < deadline, state.load_error
                time.sleep(0.05)
            for r in (client.get("/v1/vector_stores"),
                      client.post("/v1/vector_stores", json={"name": "early"}),
                      client.post("/v1/vector_stores/vs_x/search", json={"query": "fuse"})):
                assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
                assert r.json()["error"] == {"message": "the server's database is unavailable; retry shortly",
                                             "type": "service_unavailable_error", "param": None,
                                             "code": "store_unavailable"}
            r = client.post("/v1/embeddings", json={"model": state.encoder.name, "input": "no database needed"})
            assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == state.encoder.dimension

            server.start()
            started = time.monotonic()
            while (r := client.get("/v1/vector_stores")).status_code != 200:
                assert r.json()["error"]["code"] == "store_unavailable", r.text
                assert time.monotonic() - started < 30, "the loader did not retry within 30 s"   # backoff cap: 5 s
                time.sleep(0.1)
            assert r.json()["data"] == [] and state.store_error is None
            text = b"The spare fuse for the kiln is kept in the third drawer of the blue cabinet."
            file_id = client.post("/v1/files", files={"file": ("drawer.txt", text)},
                                  data={"purpose": "assistants"}).json()["id"]
            store_id = client.post("/v1/vector_stores", json={"name": "late", "file_ids": [file_id]}).json()["id"]
            while client.get(f"/v1/vector_stores/{store_id}").json()["file_counts"]["completed"] < 1:
                assert time.monotonic() - started < 120
                time.sleep(0.1)
            hits = client.post(f"/v1/vector_stores/{store_id}/search", json={"query": "where is the fuse?"}).json()
            assert hits["data"][0]["file_id"] == file_id and "third drawer" in hits["data"][0]["content"][0]["text"]
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)
