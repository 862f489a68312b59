"""The Batch API (unmask.batch) with the official openai client, on the built-in model: lines run through the
online routes' code, output and error files as OpenAI writes them, validation, cancel, and a batch that survives
`kill -9` of `unmask serve`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from store_server import start_app, wait_health

MODEL = "unmask-tiny"


def chat_line(custom_id: str, content: str = "Say hi.", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                     "temperature": 0.0, **body}}


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def upload(client: openai.OpenAI, lines: list) -> str:
    return client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.1)
    pytest.fail(f"batch {batch_id} still {batch.status} after {timeout} s")


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).read().decode().splitlines()]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    app = start_app(tmp_path_factory.mktemp("data"), max_num_seqs=8)
    app.wait_model()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


# ---------------------------------------------------------------------------------------- a batch end to end
def test_chat_batch_writes_output_and_error_files_as_openai(client, live):
    bad_body = chat_line("bad-temperature", temperature="hot")
    lines = [chat_line("a", "Say hi."), chat_line("b", "Name a colour."), "this is { not json",
             {**chat_line("wrong-url"), "url": "/v1/completions"}, bad_body, chat_line("c", "Count to three.")]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "test"})
    assert batch.status == "validating" and batch.object == "batch" and batch.id.startswith("batch_")
    assert batch.metadata == {"job": "test"} and batch.expires_at == batch.created_at + 24 * 3600
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done.errors
    assert done.request_counts.model_dump() == {"total": 6, "completed": 3, "failed": 3}
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.failed_at is None and done.cancelled_at is None and done.model == MODEL

    output = records(client, done.output_file_id)
    assert [r["custom_id"] for r in output] == ["a", "b", "c"]
    online = client.chat.completions.create(**chat_line("a")["body"])
    for r in output:
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"].startswith("req_")
        assert r["response"]["body"]["object"] == "chat.completion"
    # greedy: the batch line's answer is the online endpoint's
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == online.choices[0].message.content
    usages = [r["response"]["body"]["usage"] for r in output]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usages) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens

    errors = {r["custom_id"]: r for r in records(client, done.error_file_id)}
    assert set(errors) == {None, "wrong-url", "bad-temperature"}
    assert "line 3 is not valid JSON" in errors[None]["response"]["body"]["error"]["message"]
    assert "does not match the batch's endpoint" in errors["wrong-url"]["response"]["body"]["error"]["message"]
    # a body that is a 400 online is a 400 here with the online message
    r = httpx.post(f"{live.url}/v1/chat/completions", json=bad_body["body"], timeout=60)
    assert r.status_code == 400
    bad = errors["bad-temperature"]["response"]
    assert bad["status_code"] == 400 and bad["body"] == r.json()


def test_completions_and_responses_batches(client):
    for endpoint, body, kind in (("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 4}, "text_completion"),
                                 ("/v1/responses", {"input": "Say hi.", "max_output_tokens": 4}, "response")):
        lines = [{"custom_id": f"x{i}", "method": "POST", "url": endpoint, "body": {"model": MODEL, **body}}
                 for i in range(2)]
        lines.append({"custom_id": "streamed", "method": "POST", "url": endpoint, "body": {**body, "stream": True}})
        batch = client.batches.create(input_file_id=upload(client, lines), endpoint=endpoint,
                                      completion_window="24h")
        done = wait_for(client, batch.id, ("completed", "failed"))
        assert done.status == "completed" and done.request_counts.completed == 2, done
        assert [r["response"]["body"]["object"] for r in records(client, done.output_file_id)] == [kind, kind]
        (streamed,) = records(client, done.error_file_id)
        assert "stream is not supported" in streamed["response"]["body"]["error"]["message"]


# ---------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("lines, code, line", [
    ([chat_line("same"), chat_line("other"), chat_line("same")], "duplicate_custom_id", 3),
    ([chat_line("a"), chat_line("b", model="gpt-4o")], "model_not_found", 2),
    (["", "  "], "empty_file", None),
])
def test_batch_validation_fails_the_whole_batch(client, lines, code, line):
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_for(client, batch.id, ("failed", "completed"))
    assert done.status == "failed" and done.failed_at and done.in_progress_at is None
    assert done.output_file_id is None and done.error_file_id is None
    assert [(e.code, e.line) for e in done.errors.data] == [(code, line)]


def test_create_errors_and_unknown_ids(client):
    user_file = client.files.create(file=("u.jsonl", jsonl([chat_line("a")])), purpose="user_data").id
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=user_file, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="file-nope"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    good = upload(client, [chat_line("a")])
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=good, endpoint="/v1/images", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=good, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")


def test_list_pages_newest_first(client):
    ids = [client.batches.create(input_file_id=upload(client, [chat_line("a")]), endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    assert [b.id for b in client.batches.list(limit=2, after=ids[2]).data] == [ids[1], ids[0]]
    for batch_id in ids:
        wait_for(client, batch_id, ("completed",))
    with pytest.raises(openai.BadRequestError, match="only a validating or in-progress batch"):
        client.batches.cancel(ids[0])


# ---------------------------------------------------------------------------------------- cancel
def test_cancel_stops_new_lines_and_keeps_finished_ones(client):
    lines = [chat_line(f"r{i}", max_tokens=48) for i in range(40)]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(client, batch.id, ("cancelled",), timeout=60)
    output, errors = records(client, done.output_file_id), records(client, done.error_file_id)
    assert 1 <= len(output) < 40 and all(r["response"]["status_code"] == 200 for r in output)
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"} and all(r["response"] is None for r in errors)
    ids = [r["custom_id"] for r in output + errors]
    assert sorted(ids) == sorted(f"r{i}" for i in range(40))   # each exactly once
    assert done.request_counts.model_dump() == {"total": 40, "completed": len(output), "failed": len(errors)}
    assert client.batches.cancel(batch.id).status == "cancelled"   # again: unchanged, not an error


# ---------------------------------------------------------------------------------------- kill -9
def serve(data_dir, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "unmask.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
           "--log-level", "warning", "--max-num-seqs", "4", "--embedding-model", "off"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
    wait_health(url, ready=lambda status: status == 200, alive=lambda: proc.poll() is None)


def test_batch_survives_kill_9_and_every_custom_id_lands_once(tmp_path):
    from store_server import free_port

    port, n = free_port(), 24   # 6 land before the kill, the rest after the restart
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    lines = [chat_line(f"k{i}", f"Item {i}.", max_tokens=24) for i in range(n)]
    with open(tmp_path / "first.log", "w") as log:
        proc = serve(tmp_path / "data", port, log)
        try:
            wait_healthy(url, proc)
            batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/chat/completions",
                                          completion_window="24h")
            deadline = time.monotonic() + 180
            while (before := client.batches.retrieve(batch.id).request_counts.completed) < 6:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
    assert before < n, "the batch finished before the kill; make its lines longer"
    with open(tmp_path / "second.log", "w") as log:
        proc = serve(tmp_path / "data", port, log)
        try:
            wait_healthy(url, proc)
            resumed = client.batches.retrieve(batch.id)
            assert resumed.status == "in_progress" and resumed.request_counts.completed >= before
            done = wait_for(client, batch.id, ("completed", "failed"))
            output, errors = records(client, done.output_file_id), records(client, done.error_file_id)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert done.status == "completed" and errors == []
    assert [r["custom_id"] for r in output] == [f"k{i}" for i in range(n)]   # each once, in input order
    assert all(r["response"]["status_code"] == 200 for r in output)
    assert done.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}


def test_embeddings_batch_runs_on_the_embedding_model(client):
    name = client.models.list().data[0].id   # the language model: not the embedding model's name
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "all-MiniLM-L6-v2", "input": text}} for i, text in enumerate(["open a file", "os"])]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/embeddings",
                                  completion_window="24h")
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.model == "all-MiniLM-L6-v2", done
    out = records(client, done.output_file_id)
    assert [r["custom_id"] for r in out] == ["e0", "e1"]
    assert [len(r["response"]["body"]["data"][0]["embedding"]) for r in out] == [384, 384]
    wrong = [{**lines[0], "body": {"model": name, "input": "x"}}]
    failed = wait_for(client, client.batches.create(input_file_id=upload(client, wrong), endpoint="/v1/embeddings",
                                                    completion_window="24h").id, ("completed", "failed"))
    assert failed.status == "failed" and failed.errors.data[0].code == "model_not_found"


def test_a_batch_past_its_window_expires_with_every_line_in_the_error_file(client, monkeypatch):
    from unmask.batch import jobs

    monkeypatch.setitem(jobs.COMPLETION_WINDOW_S, "24h", -1)   # this batch's window ended before it started
    batch = client.batches.create(input_file_id=upload(client, [chat_line("x"), chat_line("y")]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, batch.id, ("expired", "completed", "failed"))
    assert done.status == "expired" and done.expired_at and done.output_file_id is None
    errors = records(client, done.error_file_id)
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [("x", "batch_expired"), ("y", "batch_expired")]
    assert done.request_counts.model_dump() == {"total": 2, "completed": 0, "failed": 2}


def test_a_batch_whose_input_file_is_deleted_fails_and_never_hangs(client, live):
    from unmask.batch.jobs import BatchJobs

    file_id = upload(client, [chat_line("a"), chat_line("b")])
    client.files.delete(file_id)
    jobs = BatchJobs(live.app.state.store.get().db)
    # as a crash could leave it: cancelling, its input file deleted meanwhile (validating would fail the same way)
    batch = jobs.create(file_id, "/v1/chat/completions", "24h", None, None)
    jobs.update(batch["id"], "cancelling")
    done = wait_for(client, batch["id"], ("failed", "cancelled"))
    assert done.status == "failed" and done.errors.data[0].code == "input_file_missing"


def test_batch_lines_reach_the_engine_at_batch_priority(client, live, monkeypatch):
    from unmask.engine.params import BATCH_PRIORITY

    engine = live.app.state.serving.engine.engine
    seen: list[tuple[int, int]] = []   # (priority, prompt length) of every engine request
    original = engine.add_request

    def recording(prompt_ids, params=None, request_id=None):
        seen.append((params.priority, len(prompt_ids)))
        return original(prompt_ids, params, request_id)

    monkeypatch.setattr(engine, "add_request", recording)
    lines = [chat_line("chat"),
             {"custom_id": "text", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "def f(x):", "max_tokens": 4}},
             {"custom_id": "fim", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "def f(x):\n    return ", "suffix": "\n", "max_tokens": 4}}]
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        mine = [x for x in lines if x["url"] == endpoint]
        done = wait_for(client, client.batches.create(input_file_id=upload(client, mine), endpoint=endpoint,
                                                      completion_window="24h").id, ("completed", "failed"))
        assert done.request_counts.completed == len(mine), done
    assert [p for p, _ in seen] == [BATCH_PRIORITY] * 3
    client.chat.completions.create(**chat_line("online")["body"])
    assert seen[-1][0] == 0   # an online request keeps the interactive priority


def test_a_running_batch_takes_no_admission_slot(tmp_path):
    """On a server that admits 2 requests in all, a running batch (2 lines in flight) leaves both to clients."""
    app = start_app(tmp_path / "data", max_num_seqs=2, max_queue=0, embedding_model="off")
    try:
        app.wait_model()
        client = app.client()
        batch = client.batches.create(input_file_id=upload(client, [chat_line(f"r{i}", max_tokens=32)
                                                                    for i in range(30)]),
                                      endpoint="/v1/chat/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 1:
            time.sleep(0.05)
        for i in range(3):   # a 429 here would raise openai.RateLimitError
            assert client.chat.completions.create(**chat_line("online", f"Hi {i}.")["body"]).choices[0].message
        assert client.batches.retrieve(batch.id).status == "in_progress"
        client.batches.cancel(batch.id)
        wait_for(client, batch.id, ("cancelled",))
    finally:
        app.stop()
