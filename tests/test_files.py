"""The file store (unmask.store) and the Files API as the official openai client uses it."""
from __future__ import annotations

import io
import sqlite3
import threading
from pathlib import Path

import httpx
import openai
import pytest

from store_server import start_app
from unmask.store import FileNotFound, FileTooLargeError, open_store
from unmask.store.db import DB_NAME, default_data_dir
from unmask.store.schema import MIGRATIONS

MAX_FILE = 5000
MAX_BODY = 1000   # under MAX_FILE: uploads are bounded by --max-file-bytes, other bodies by --max-body-bytes


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    app = start_app(data, max_file_bytes=MAX_FILE, max_body_bytes=MAX_BODY)
    yield app, data
    app.stop()


@pytest.fixture(scope="module")
def client(live):
    return live[0].client()


def envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---------------------------------------------------------------------------------------- the API
def test_upload_list_retrieve_content_delete_with_the_openai_client(client, live):
    payload = b'{"a": 1}\n' * 300   # 2700 bytes: over --max-body-bytes, under --max-file-bytes
    f = client.files.create(file=("data.jsonl", payload), purpose="batch")
    assert f.object == "file" and f.id.startswith("file-") and f.bytes == len(payload)
    assert f.filename == "data.jsonl" and f.purpose == "batch" and f.status == "processed"
    assert client.files.retrieve(f.id).model_dump() == f.model_dump()
    assert client.files.content(f.id).read() == payload
    assert (live[1] / "files" / f.id).read_bytes() == payload   # stored under its id
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    deleted = client.files.delete(f.id)
    assert deleted.id == f.id and deleted.deleted is True
    assert not (live[1] / "files" / f.id).exists()
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError, match=f.id):
            call(f.id)


def test_list_orders_filters_and_pages(client):
    ids = [client.files.create(file=(f"f{i}.txt", f"text {i}".encode()), purpose="user_data").id for i in range(5)]
    other = client.files.create(file=("x.txt", b"x"), purpose="assistants").id
    newest_first = [f.id for f in client.files.list(purpose="user_data")]
    assert newest_first[:5] == ids[::-1] and other not in newest_first
    page = client.files.list(purpose="user_data", limit=2, order="asc")
    assert [f.id for f in page.data] == newest_first[::-1][:2] and page.has_more
    # the client's auto-pagination follows `after` through every page
    assert [f.id for f in client.files.list(purpose="user_data", limit=2, order="asc")] == newest_first[::-1]
    assert [f.id for f in client.files.list(purpose="user_data", limit=2, after=ids[3]).data] == ids[2::-1][:2]
    with pytest.raises(openai.NotFoundError):
        client.files.list(after="file-nope").data
    for query in ({"order": "sideways"}, {"limit": 0}, {"limit": 10001}):
        with pytest.raises(openai.BadRequestError):
            client.files.list(**query).data


def test_bad_uploads_are_400s_that_say_what_to_send(client, live):
    url = live[0].url
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune' is not supported"):
        client.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")
    err = envelope(httpx.post(f"{url}/v1/files", json={"purpose": "batch"}), 400)
    assert err["code"] == "invalid_content_type" and "multipart/form-data" in err["message"]
    err = envelope(httpx.post(f"{url}/v1/files", data={"purpose": "batch"}, files={"other": ("a", b"1")}), 400)
    assert err["param"] == "file"
    err = envelope(httpx.post(f"{url}/v1/files", files={"file": ("a.txt", b"1")}), 400)
    assert err["param"] == "purpose" and "missing" in err["message"]
    err = envelope(httpx.post(f"{url}/v1/files", content=b"--x\r\ngarbage",
                              headers={"Content-Type": "multipart/form-data; boundary=x"}), 400)


def test_file_limit_is_413_and_other_bodies_keep_the_body_limit(client, live):
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.bin", b"x" * (MAX_FILE + 1)), purpose="user_data")
    assert e.value.status_code == 413 and f"{MAX_FILE} bytes (--max-file-bytes)" in e.value.message
    ok = client.files.create(file=("fits.bin", b"x" * MAX_FILE), purpose="user_data")
    assert ok.bytes == MAX_FILE
    # far over: refused by the middleware from Content-Length, before the body is read
    with pytest.raises(openai.APIStatusError, match="--max-file-bytes") as e:
        client.files.create(file=("huge.bin", b"x" * (MAX_FILE + 100_000)), purpose="user_data")
    assert e.value.status_code == 413
    r = httpx.post(f"{live[0].url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 2000}]})
    assert "--max-body-bytes" in envelope(r, 413)["message"]
    names = {p.name for p in (live[1] / "tmp").iterdir()}
    assert not names, names   # refused uploads leave no temporary file


def test_a_filename_never_leaves_the_data_directory(client, live):
    f = client.files.create(file=("../../escape.txt", b"inside"), purpose="user_data")
    assert f.filename == "escape.txt"
    assert (live[1] / "files" / f.id).read_bytes() == b"inside"
    assert not (live[1].parent / "escape.txt").exists() and not (live[1] / "escape.txt").exists()


def test_parallel_clients(client, live):
    errors: list[BaseException] = []
    made: list[str] = []

    def work(i: int) -> None:
        try:
            c = live[0].client()
            body = f"client {i}\n".encode() * 10
            f = c.files.create(file=(f"p{i}.txt", body), purpose="assistants")
            assert c.files.content(f.id).read() == body
            assert c.files.retrieve(f.id).bytes == len(body)
            c.files.list(purpose="assistants", limit=5).data
            if i % 2:
                c.files.delete(f.id)
            else:
                made.append(f.id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    listed = {f.id for f in client.files.list(purpose="assistants")}
    assert set(made) <= listed and len(made) == 6
    assert len(listed & {f.name for f in (live[1] / "files").iterdir()}) == len(listed)


# ---------------------------------------------------------------------------------------- the store itself
def test_store_survives_reopening_and_runs_delete_hooks(tmp_path):
    store = open_store(tmp_path, max_file_bytes=100)
    f = store.files.create(io.BytesIO(b"hello"), "h.txt", "user_data")
    store.close()
    store = open_store(tmp_path, max_file_bytes=100)
    assert store.files.get(f.id) == f and store.files.read_bytes(f.id) == b"hello"
    seen = []
    store.files.on_delete.append(lambda stored: 1 / 0)   # a failing subscriber does not stop the others
    store.files.on_delete.append(seen.append)
    assert store.files.delete(f.id) == f and seen == [f]
    with pytest.raises(FileNotFound):
        store.files.get(f.id)
    with pytest.raises(FileTooLargeError):
        store.files.create(b"x" * 101, "big", "user_data")
    assert store.files.create(b"x" * 101, "out.jsonl", "batch_output", max_bytes=1000).bytes == 101
    assert sqlite3.connect(tmp_path / DB_NAME).execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert sqlite3.connect(tmp_path / DB_NAME).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_bytes_without_a_row_are_swept_when_the_store_opens(tmp_path):
    store = open_store(tmp_path)
    kept = store.files.create(b"kept", "k", "user_data")
    (tmp_path / "files" / "file-orphan").write_bytes(b"crash after rename, before the row")
    (tmp_path / "tmp" / "file-x.partial").write_bytes(b"crash mid-write")
    store.close()
    store = open_store(tmp_path)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [kept.id]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("UNMASK_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == tmp_path / "xdg" / "unmask"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_data_dir() == Path.home() / ".local" / "share" / "unmask"
    monkeypatch.setenv("UNMASK_DATA_DIR", str(tmp_path / "mine"))
    assert default_data_dir() == tmp_path / "mine"
