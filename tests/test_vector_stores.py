"""The vector stores API on a real `unmask serve`, through the openai client (and httpx where the wire matters),
on both backends: SQLite under the data directory, and a real PostgreSQL + pgvector server (tests/pg_server.py)."""
from __future__ import annotations

import io
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest

from pg_server import postgres  # noqa: F401 - the session's Postgres server

DOCS = {
    "json.md": "# json\nThe json module encodes and decodes JSON. json.dumps serialises an object to a JSON string; "
               "json.loads parses one.",
    "paths.rst": "os.path\n=======\nos.path.join joins one or more path components intelligently.",
    "sockets.txt": "The socket module gives access to the BSD socket interface for network connections.",
    "zipping.py": "# zipfile reads and writes ZIP archives\nimport zipfile\nzipfile.ZipFile('a.zip').extractall()\n",
    "locks.html": "<html><head><style>p {}</style></head><body><h1>threading</h1><p>threading.Lock is a primitive "
                  "lock; <b>acquire</b> blocks until the lock is released.</p></body></html>",
}
ATTRIBUTES = {"json.md": {"topic": "data", "year": 2020}, "paths.rst": {"topic": "files", "year": 2021},
              "sockets.txt": {"topic": "net", "year": 2022}, "zipping.py": {"topic": "files", "year": 2023},
              "locks.html": {"topic": "threads", "year": 2024}}


def _start(tmp, backend: str, data_dir, request):
    from test_server import Server, make_text_checkpoint

    flags = ["--data-dir", str(data_dir)]
    if backend == "postgres":
        import psycopg

        server = request.getfixturevalue("postgres")
        db = "vs_" + uuid.uuid4().hex[:8]
        with psycopg.connect(server.url, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {db}")
        flags += ["--vector-store", server.url.rsplit("/", 1)[0] + "/" + db]
    model = tmp / "model"
    if not model.exists():
        make_text_checkpoint(model)
    return Server(model, tmp / f"log-{time.monotonic_ns()}.txt", *flags).wait_ready(), flags


def start_with_docs(request, tmp_path_factory, prefix: str):
    """A server on the backend `request.param`, with DOCS uploaded: (server, client, {filename: file id})."""
    tmp = tmp_path_factory.mktemp(f"{prefix}-{request.param}")
    server, _ = _start(tmp, request.param, tmp / "data", request)
    client = server.client()
    file_ids = {name: client.files.create(file=(name, io.BytesIO(text.encode())), purpose="assistants").id
                for name, text in DOCS.items()}
    return server, client, file_ids


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served(request, tmp_path_factory):
    server, client, file_ids = start_with_docs(request, tmp_path_factory, "vs")
    yield server, client, file_ids, request.param
    server.stop()


def _store_with_all(client, file_ids):
    store = client.vector_stores.create(name="docs", metadata={"team": "a"})
    batch = client.vector_stores.file_batches.create_and_poll(
        vector_store_id=store.id, files=[{"file_id": fid, "attributes": ATTRIBUTES[name]}
                                         for name, fid in file_ids.items()], poll_interval_ms=100)
    assert batch.status == "completed" and batch.file_counts.completed == len(DOCS)
    return store


def test_openai_client_end_to_end(served):
    server, client, file_ids, _ = served
    store = client.vector_stores.create(name="one")
    assert (store.object, store.name, store.status, store.file_counts.total) == ("vector_store", "one", "completed", 0)
    vs_file = client.vector_stores.files.create_and_poll(vector_store_id=store.id, file_id=file_ids["json.md"],
                                                         attributes={"topic": "data"}, poll_interval_ms=100)
    assert (vs_file.status, vs_file.last_error, vs_file.attributes) == ("completed", None, {"topic": "data"})
    assert vs_file.chunking_strategy.static.max_chunk_size_tokens == 800 and vs_file.usage_bytes > 0
    page = client.vector_stores.search(vector_store_id=store.id, query="How do I parse a JSON string?")
    result = page.data[0]
    assert (result.file_id, result.filename, result.attributes) == (file_ids["json.md"], "json.md", {"topic": "data"})
    assert result.content[0].type == "text" and result.content[0].text == DOCS["json.md"]
    assert 0 < result.score <= 1
    got = client.vector_stores.retrieve(store.id)
    assert got.file_counts.completed == 1 and got.usage_bytes == vs_file.usage_bytes
    updated = client.vector_stores.update(store.id, name="renamed", metadata={"k": "v"},
                                          expires_after={"anchor": "last_active_at", "days": 2})
    assert (updated.name, updated.metadata, updated.status) == ("renamed", {"k": "v"}, "completed")
    assert updated.expires_at == updated.last_active_at + 2 * 86400
    assert client.vector_stores.delete(store.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.vector_stores.retrieve(store.id)


def test_search_modes_filters_and_threshold(served):
    server, client, file_ids, _ = served
    store = _store_with_all(client, file_ids)
    url = f"{server.url}/v1/vector_stores/{store.id}/search"

    def search(**body):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    assert search(query="BSD socket network")["data"][0]["filename"] == "sockets.txt"
    assert search(query="extractall", search_mode="keyword")["data"][0]["filename"] == "zipping.py"
    assert [d["filename"] for d in search(query="extractall", search_mode="keyword")["data"]] == ["zipping.py"]
    assert search(query="acquire a mutual exclusion primitive", search_mode="vector")["data"][0]["filename"] == \
        "locks.html"
    html_text = search(query="primitive lock", search_mode="keyword")["data"][0]["content"][0]["text"]
    assert "<b>" not in html_text and "p {}" not in html_text and "acquire blocks" in html_text
    files = search(query="files", filters={"type": "eq", "key": "topic", "value": "files"})["data"]
    assert {d["filename"] for d in files} == {"paths.rst", "zipping.py"}
    compound = {"type": "or", "filters": [{"type": "gte", "key": "year", "value": 2024},
                                          {"type": "and", "filters": [{"type": "eq", "key": "topic", "value": "data"},
                                                                      {"type": "lt", "key": "year", "value": 2021}]}]}
    assert {d["filename"] for d in search(query="module", filters=compound)["data"]} == {"locks.html", "json.md"}
    full = search(query="module", max_num_results=50)
    assert len(full["data"]) == 5 and full["search_query"] == ["module"]
    assert len(search(query="module", max_num_results=2)["data"]) == 2
    scores = [d["score"] for d in full["data"]]
    cut = search(query="module", ranking_options={"score_threshold": scores[1]})["data"]
    assert [d["score"] for d in cut] == scores[:2]
    sdk = client.vector_stores.search(vector_store_id=store.id, query="path components",
                                      filters={"type": "ne", "key": "topic", "value": "files"})
    assert "paths.rst" not in {d.filename for d in sdk.data}


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/vector_stores/vs_nope", None, 404, "no vector store with id 'vs_nope'"),
    ("/v1/vector_stores/vs_nope/search", {"query": "x"}, 404, "no vector store"),
    ("/v1/vector_stores", {"file_ids": ["file-nope"]}, 404, "no file with id 'file-nope'"),
    ("/v1/vector_stores", {"chunking_strategy": {"type": "static", "static": {"max_chunk_size_tokens": 50,
                                                                             "chunk_overlap_tokens": 0}}},
     400, "between 100 and 4096"),
    ("/v1/vector_stores", {"name": 5}, 400, "name"),
    ("/v1/vector_stores", {"expires_after": {"anchor": "last_active_at", "days": 0}}, 400, "expires_after.days"),
])
def test_bad_requests_are_openai_errors(served, path, body, status, fragment):
    server = served[0]
    r = httpx.request("POST" if body is not None else "GET", server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


def test_unsearchable_files_are_400_naming_the_file(served):
    server, client, _, _ = served
    store = client.vector_stores.create(name="bad")
    binary = client.files.create(file=("blob.bin", io.BytesIO(b"\x00\x01")), purpose="assistants").id
    latin = client.files.create(file=("notes.txt", io.BytesIO("café".encode("latin-1"))), purpose="assistants").id
    for fid, fragment in ((binary, "'blob.bin': type '.bin' is not supported"), (latin, "'notes.txt' is not UTF-8")):
        r = httpx.post(f"{server.url}/v1/vector_stores/{store.id}/files", json={"file_id": fid}, timeout=30)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    search = f"{server.url}/v1/vector_stores/{store.id}/search"
    for body, fragment in (({"query": "x", "max_num_results": 51}, "between 1 and 50"),
                           ({"query": "x", "max_num_results": 0}, "between 1 and 50"),
                           ({"query": "  "}, "must not be empty"),
                           ({"query": "x", "filters": {"type": "like", "key": "a", "value": 1}}, "filters.type"),
                           ({"query": "x", "ranking_options": {"score_threshold": 2.0}}, "between 0 and 1")):
        r = httpx.post(search, json=body, timeout=30)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], (body, r.text)


def test_deleted_file_leaves_every_store_and_search_at_once(served):
    server, client, _, _ = served
    fid = client.files.create(file=("gone.md", io.BytesIO(b"The quux frobnicator is unique.")),
                              purpose="assistants").id
    stores = [client.vector_stores.create(name=f"s{i}", file_ids=[fid]) for i in range(2)]
    for s in stores:
        _wait_completed(client, s.id)
        assert client.vector_stores.search(vector_store_id=s.id, query="quux frobnicator").data[0].file_id == fid
    assert client.files.delete(fid).deleted
    for s in stores:
        assert client.vector_stores.search(vector_store_id=s.id, query="quux frobnicator").data == []
        assert client.vector_stores.files.list(vector_store_id=s.id).data == []
        assert client.vector_stores.retrieve(s.id).file_counts.total == 0
    detach = client.files.create(file=("d.md", io.BytesIO(b"zyzzyva beetles")), purpose="assistants").id
    client.vector_stores.files.create_and_poll(vector_store_id=stores[0].id, file_id=detach, poll_interval_ms=100)
    assert client.vector_stores.files.delete(file_id=detach, vector_store_id=stores[0].id).deleted
    assert client.vector_stores.search(vector_store_id=stores[0].id, query="zyzzyva").data == []
    assert client.files.retrieve(detach).id == detach   # detaching keeps the file


def _wait_completed(client, store_id, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        store = client.vector_stores.retrieve(store_id)
        if store.status == "completed":
            return store
        time.sleep(0.1)
    pytest.fail(f"vector store {store_id} still in progress after {timeout} s")


def test_listing_pages_and_batches(served):
    server, client, file_ids, _ = served
    store = client.vector_stores.create(name="pages")
    batch = client.vector_stores.file_batches.create_and_poll(vector_store_id=store.id,
                                                              file_ids=list(file_ids.values()), poll_interval_ms=100)
    assert batch.object == "vector_store.files_batch" and batch.file_counts.total == 5
    first = client.vector_stores.files.list(vector_store_id=store.id, limit=2, order="asc")
    assert len(first.data) == 2 and first.has_more
    rest = client.vector_stores.files.list(vector_store_id=store.id, limit=10, order="asc", after=first.data[-1].id)
    assert [f.id for f in first.data + rest.data] == list(file_ids.values())
    in_batch = client.vector_stores.file_batches.list_files(batch_id=batch.id, vector_store_id=store.id, limit=100)
    assert {f.id for f in in_batch.data} == set(file_ids.values())
    assert client.vector_stores.files.list(vector_store_id=store.id, filter="failed").data == []
    updated = client.vector_stores.files.update(file_id=file_ids["json.md"], vector_store_id=store.id,
                                                attributes={"lang": "en"})
    assert updated.attributes == {"lang": "en"}
    hit = client.vector_stores.search(vector_store_id=store.id, query="json.loads parses",
                                      filters={"type": "eq", "key": "lang", "value": "en"})
    assert [d.filename for d in hit.data] == ["json.md"]
    names = {s.id for s in client.vector_stores.list(limit=100).data}
    assert store.id in names


def test_parallel_clients_upload_attach_and_search(served):
    server, client, file_ids, _ = served
    store = client.vector_stores.create(name="parallel", file_ids=[file_ids["sockets.txt"]])
    _wait_completed(client, store.id)
    errors: list[BaseException] = []
    uploaded: list[str] = []

    def uploader(i: int):
        try:
            c = server.client()
            fid = c.files.create(file=(f"p{i}.md", io.BytesIO(f"parallel document number {i} tok{i}x".encode())),
                                 purpose="assistants").id
            c.vector_stores.files.create(vector_store_id=store.id, file_id=fid)
            uploaded.append(fid)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def searcher():
        try:
            c = server.client()
            for _ in range(5):
                assert c.vector_stores.search(vector_store_id=store.id, query="BSD socket").data[0].filename == \
                    "sockets.txt"
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=uploader, args=(i,)) for i in range(6)] + \
              [threading.Thread(target=searcher) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    done = _wait_completed(client, store.id)
    assert done.file_counts.completed == 7
    for i in range(6):
        hits = httpx.post(f"{server.url}/v1/vector_stores/{store.id}/search",
                          json={"query": f"tok{i}x", "search_mode": "keyword"}, timeout=30).json()
        assert [d["filename"] for d in hits["data"]] == [f"p{i}.md"]


def test_ingestion_survives_a_crash(tmp_path, request):
    """A server killed (SIGKILL) mid-ingestion loses nothing that answered 200: the file resumes on restart."""
    backend = "sqlite"
    server, flags = _start(tmp_path, backend, tmp_path / "data", request)
    client = server.client()
    big = "\n\n".join(f"Paragraph {i}: the {['red', 'green', 'blue'][i % 3]} widget number {i} is stored in bin "
                      f"{i * 7}." for i in range(500))   # seconds of ingestion: in progress at the kill
    fid = client.files.create(file=("big.md", io.BytesIO(big.encode())), purpose="assistants").id
    store = client.vector_stores.create(name="crash", file_ids=[fid],
                                        chunking_strategy={"type": "static", "static": {
                                            "max_chunk_size_tokens": 100, "chunk_overlap_tokens": 0}})
    assert client.vector_stores.retrieve(store.id).status == "in_progress"
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    from test_server import Server

    again = Server(tmp_path / "model", tmp_path / "log2.txt", *flags).wait_ready()
    try:
        c = again.client()
        done = _wait_completed(c, store.id, timeout=300)
        assert done.file_counts.completed == 1 and done.name == "crash"
        hit = c.vector_stores.search(vector_store_id=store.id, query="widget 499",
                                     extra_body={"search_mode": "keyword"})
        assert "number 499 " in hit.data[0].content[0].text   # the last paragraph
    finally:
        again.stop()


def test_a_pdf_is_searched_by_its_text(served):
    from test_extract import make_pdf

    server, client, _, _ = served
    fid = client.files.create(file=("guide.pdf", io.BytesIO(make_pdf(["Cover page.", "The sprocket calibration "
                                                                      "needs a torque of 12 newton metres."]))),
                              purpose="assistants").id
    store = client.vector_stores.create(name="pdf", file_ids=[fid])
    _wait_completed(client, store.id)
    hit = client.vector_stores.search(vector_store_id=store.id, query="sprocket torque").data[0]
    assert hit.filename == "guide.pdf" and "12 newton metres" in hit.content[0].text
    scan = client.files.create(file=("scan.pdf", io.BytesIO(make_pdf([""]))), purpose="assistants").id
    r = httpx.post(f"{server.url}/v1/vector_stores/{store.id}/files", json={"file_id": scan}, timeout=30)
    assert r.status_code == 400 and "'scan.pdf' has no text layer" in r.json()["error"]["message"], r.text
