"""The file_search tool of /v1/responses on a real `unmask serve`, through the openai client, on both backends:
retrieval before generation, the file_search_call item (with results on request), file_citation annotations,
and the streamed events in order."""
from __future__ import annotations

import httpx
import pytest

from pg_server import postgres  # noqa: F401 - the session's Postgres server
from test_vector_stores import DOCS, start_with_docs
from unmask.retrieval.file_search import FileSearch, fit, split_tools
from unmask.server.protocol import APIError

QUESTION = "How do I parse a JSON string with json.loads?"


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served(request, tmp_path_factory):
    server, client, ids = start_with_docs(request, tmp_path_factory, "fs")
    store = client.vector_stores.create(name="docs")
    batch = client.vector_stores.file_batches.create_and_poll(vector_store_id=store.id, file_ids=list(ids.values()),
                                                              poll_interval_ms=100)
    assert batch.status == "completed"
    yield server, client, store.id, ids
    server.stop()


def _tool(store_id: str, **kw) -> dict:
    return {"type": "file_search", "vector_store_ids": [store_id], **kw}


def test_responses_with_file_search(served):
    server, client, store_id, ids = served
    plain = client.responses.create(input=QUESTION, max_output_tokens=8, temperature=0)
    r = client.responses.create(input=QUESTION, max_output_tokens=8, temperature=0,
                                tools=[_tool(store_id, max_num_results=2)], include=["file_search_call.results"])
    call, message = r.output[0], r.output[1]
    assert (call.type, call.status, call.queries) == ("file_search_call", "completed", [QUESTION])
    assert len(call.results) == 2 and call.results[0].file_id == ids["json.md"]
    assert call.results[0].filename == "json.md" and call.results[0].text == DOCS["json.md"]
    assert 0 < call.results[0].score <= 1
    notes = message.content[0].annotations
    assert [(a.type, a.file_id) for a in notes] == [("file_citation", res.file_id) for res in call.results]
    assert all(a.index == len(message.content[0].text) for a in notes)
    # the excerpts are in the prompt: it grew by at least the retrieved text
    assert r.usage.input_tokens > plain.usage.input_tokens + 20
    assert r.tools[0].type == "file_search"
    without = client.responses.create(input=QUESTION, max_output_tokens=4, tools=[_tool(store_id)])
    assert without.output[0].type == "file_search_call" and without.output[0].results is None


def test_filters_and_the_function_tools_beside_it(served):
    server, client, store_id, ids = served
    only_paths = {"type": "eq", "key": "missing", "value": 1}   # no file has the key: nothing is found
    r = client.responses.create(input=QUESTION, max_output_tokens=4, include=["file_search_call.results"],
                                tools=[_tool(store_id, filters=only_paths)])
    assert r.output[0].results == [] and r.output[1].content[0].annotations == []
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    r = client.responses.create(input=QUESTION, max_output_tokens=4, tools=[_tool(store_id), weather],
                                tool_choice="none")
    assert r.output[0].type == "file_search_call" and len(r.tools) == 2


def test_stream_events_in_order(served):
    server, client, store_id, ids = served
    stream = client.responses.create(input=QUESTION, max_output_tokens=8, stream=True,
                                     tools=[_tool(store_id, max_num_results=1)], include=["file_search_call.results"])
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:7] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.file_search_call.in_progress", "response.file_search_call.searching",
                         "response.file_search_call.completed", "response.output_item.done"]
    assert events[2].item.status == "in_progress" and events[6].item.results[0].file_id == ids["json.md"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    note = kinds.index("response.output_text.annotation.added")
    assert note < kinds.index("response.output_text.done") and events[note].annotation.file_id == ids["json.md"]
    final = events[-1].response
    assert kinds[-1] == "response.completed" or kinds[-1] == "response.incomplete"
    assert final.output[0].type == "file_search_call" and final.output[1].content[0].annotations[0].file_id == \
        ids["json.md"]


@pytest.mark.parametrize("tool, status, fragment", [
    ({"type": "file_search", "vector_store_ids": ["vs_nope"]}, 404, "no vector store with id 'vs_nope'"),
    ({"type": "file_search"}, 400, "vector_store_ids must be a non-empty list"),
    ({"type": "file_search", "vector_store_ids": ["x"], "max_num_results": 0}, 400, "between 1 and 50"),
    ({"type": "file_search", "vector_store_ids": ["x"], "filters": {"type": "eq"}}, 400, "tools[0].filters.key"),
])
def test_bad_file_search_tools(served, tool, status, fragment):
    server = served[0]
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "max_output_tokens": 2, "tools": [tool]},
                   timeout=60)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


def test_results_are_cut_to_the_token_budget():
    tools, search = split_tools([{"type": "file_search", "vector_store_ids": ["vs_a", "vs_a"]}])
    assert tools is None and search.store_ids == ["vs_a"] and search.max_results == 10
    search.results = [{"file_id": f"file-{i}", "filename": f"f{i}.md", "score": 1 - i / 10, "text": "word " * 50,
                       "attributes": {}} for i in range(5)]
    words = lambda text: len(text.split())   # noqa: E731 - a token counter for the test
    context = fit(search, words, budget=words(FileSearch.context(search, 2)))
    assert search.used == 2 and "[2] f1.md" in context and "[3]" not in context
    assert [a["file_id"] for a in search.annotations("x" * 7)] == ["file-0", "file-1"]
    assert fit(search, words, budget=3) == "" and search.used == 0 and search.annotations("") == []


def test_citations_sit_at_the_sentences_their_excerpts_support():
    _, search = split_tools([{"type": "file_search", "vector_store_ids": ["vs_a"]}])
    search.results = [
        {"file_id": "file-j", "filename": "json.md", "text": "json.dumps serialises an object to a JSON string."},
        {"file_id": "file-s", "filename": "sockets.txt", "text": "The socket module gives access to the BSD socket "
                                                                 "interface for network connections."},
        {"file_id": "file-z", "filename": "zip.py", "text": "zipfile reads and writes ZIP archives."}]
    search.used = 3
    text = ("Use json.dumps to turn an object into a JSON string. Hello there! "
            "For network connections, the socket module wraps the BSD interface.\nDone")
    notes = search.annotations(text)
    first, second = text.index("string.") + len("string."), text.index("interface.") + len("interface.")
    assert [(n["index"], n["file_id"], n["filename"]) for n in notes] == [
        (first, "file-j", "json.md"), (second, "file-s", "sockets.txt"), (len(text), "file-z", "zip.py")]
    # a sentence that shares too few words with every excerpt cites nothing; the files then sit at the end
    assert [(n["index"], n["file_id"]) for n in search.annotations("An object here.")] == [
        (15, "file-j"), (15, "file-s"), (15, "file-z")]
    with pytest.raises(APIError, match="at most one file_search"):
        split_tools([{"type": "file_search", "vector_store_ids": ["a"]}] * 2)


# ---------------------------------------------------------------------------------------- chat completions
def test_chat_completions_with_file_search(served):
    server, client, store_id, ids = served
    messages = [{"role": "user", "content": QUESTION}]
    plain = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 4},
                       timeout=60).json()
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 4, "n": 2, "tools": [_tool(store_id, max_num_results=2)]}).json()
    for choice in r["choices"]:
        notes = choice["message"]["annotations"]
        assert notes[0] == {"type": "file_citation", "index": len(choice["message"]["content"] or ""),
                            "file_id": ids["json.md"], "filename": "json.md"} and len(notes) == 2
    assert r["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
    assert "annotations" not in plain["choices"][0]["message"]
    sdk = client.chat.completions.create(model=r["model"], messages=messages, max_tokens=4,
                                         tools=[_tool(store_id, max_num_results=1)])
    assert sdk.choices[0].message.to_dict()["annotations"][0]["file_id"] == ids["json.md"]


def test_chat_stream_cites_on_the_finishing_delta(served):
    server, client, store_id, ids = served
    stream = client.chat.completions.create(model=client.models.list().data[0].id,
                                            messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
                                            stream=True, tools=[_tool(store_id, max_num_results=1)])
    chunks = [c.to_dict() for c in stream]
    finishing = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(finishing) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert finishing[0]["choices"][0]["delta"]["annotations"] == [
        {"type": "file_citation", "index": len(text), "file_id": ids["json.md"], "filename": "json.md"}]
    assert all("annotations" not in c["choices"][0]["delta"] for c in chunks if c not in finishing and c["choices"])
