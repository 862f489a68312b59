"""What outside tools found in the server (issue 30): tool calls in chat history, chat-template failures,
the OpenAPI document, 405s, and client text reaching the log.

The server runs in this process (uvicorn in a thread, `live_server`) on the built-in model, so that its log
records reach caplog (test_fuzz.py starts its own, in a subprocess).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter

import httpx
import jinja2
import pytest

from unmask.server.protocol import APIError, ChatMessage

USER = {"role": "user", "content": "What time is it?"}


@pytest.fixture(scope="module")
def live_server():
    """The built-in model behind uvicorn in a thread, on a free loopback port; yields its base URL."""
    import uvicorn

    from unmask.defaults import default_model_path
    from unmask.server.app import ServerArgs, create_app

    args = ServerArgs(model=default_model_path(), served_model_name="unmask-tiny", max_num_seqs=4, max_queue=4,
                      default_max_tokens=4)
    app = create_app(args)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while app.state.load_error is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        pytest.fail(f"server not ready: {app.state.load_error}")
    yield url
    server.should_exit = True
    thread.join(60)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def envelope(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def history(*calls) -> list[dict]:
    return [USER, {"role": "assistant", "content": "", "tool_calls": list(calls)}, {"role": "user", "content": "ok"}]


CALL = {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}


# ---------------------------------------------------------------------------------------- tool calls in history
@pytest.mark.parametrize("call, param, words", [
    ({}, "messages[1].tool_calls[0].id", "Missing required parameter"),
    ({"id": "c", "type": "function"}, "messages[1].tool_calls[0].function", "Missing required parameter"),
    ({"id": "c", "type": "function", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name",
     "Missing required parameter"),
    ({"id": "c", "type": "function", "function": {"name": "f"}}, "messages[1].tool_calls[0].function.arguments",
     "Missing required parameter"),
    ({"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
     "messages[1].tool_calls[0].function.arguments", "expected a string"),
    ({"id": "c", "type": "function", "function": "f"}, "messages[1].tool_calls[0].function", "expected an object"),
    ({"id": 7, "type": "function", "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].id",
     "expected a string"),
    ({"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].type",
     "'function'"),
])
def test_incomplete_tool_calls_in_history_are_400s_naming_the_field(live_server, call, param, words):
    for path in ("/v1/chat/completions", "/tokenize"):
        err = envelope(post(live_server, path, {"messages": history(CALL, call), "max_tokens": 1}), 400)
        second = param.replace("tool_calls[0]", "tool_calls[1]")
        assert err["param"] == second and second in err["message"] and words in err["message"], err
        assert err["type"] == "invalid_request_error"


def test_tool_calls_only_on_assistant_messages(live_server):
    body = {"messages": [{**USER, "tool_calls": [CALL]}], "max_tokens": 1}
    err = envelope(post(live_server, "/v1/chat/completions", body), 400, "messages[0].tool_calls")
    assert "assistant" in err["message"]


def test_complete_tool_calls_in_history_are_answered(live_server):
    r = post(live_server, "/v1/chat/completions", {"messages": history(CALL), "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------------------------------- template failures
class TemplateTokenizer:
    """apply_chat_template of a Jinja template, as transformers renders it (raise_exception, tojson)."""

    def __init__(self, template: str):
        env = jinja2.Environment()

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v: json.dumps(v)
        self.template = env.from_string(template)
        self.renders = 0

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        self.renders += 1
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


def test_any_template_failure_is_a_400_naming_the_message():
    from unmask.server.chat_history import render

    tok = TemplateTokenizer("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                            "{% if m.role == 'tool' %}{{ m.extra | tojson }}{% endif %}\n{% endfor %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"},
            {"role": "user", "content": "d"}, {"role": "assistant", "content": "e"}]
    source = [ChatMessage(**m) for m in msgs]
    assert render(tok, msgs[:2], None, True, source=source[:2]) == "user:a\nassistant:b\n"
    with pytest.raises(APIError) as e:   # a TypeError (tojson of an undefined value) was a 500
        render(tok, msgs, None, True, source=source)
    assert e.value.status == 400 and e.value.param == "messages[2]" and e.value.code == "invalid_chat_history"
    assert "messages[2]" in e.value.message and "TypeError" in e.value.message
    assert tok.renders <= 2 + 1 + 4   # the bisection: a few renders, not one per message
    with pytest.raises(APIError) as e:   # rewritten messages (tool history as text): only the field is named
        render(tok, msgs, None, True, param="input", source=None)
    assert e.value.status == 400 and e.value.param == "input"


def test_a_templates_own_exception_names_the_message():
    from unmask.server.chat_history import render

    tok = TemplateTokenizer("{% for m in messages %}{% if loop.index0 % 2 == 0 and m.role != 'user' %}"
                            "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                            "{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": "c"}]
    with pytest.raises(APIError) as e:
        render(tok, msgs, None, True, source=[ChatMessage(**m) for m in msgs])
    assert e.value.param == "messages[2]" and "roles must alternate" in e.value.message
    # a failure that no message causes (here: `tools`) names the field, not a message
    tok = TemplateTokenizer("{{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(APIError) as e:
        render(tok, msgs[:2], None, True, source=[ChatMessage(**m) for m in msgs[:2]])
    assert e.value.status == 400 and e.value.param == "messages"


# ---------------------------------------------------------------------------------------- the OpenAPI document
def test_openapi_operations_have_unique_ids_and_declare_what_is_sent(live_server):
    from unmask.server.openapi import OPERATIONS

    doc = httpx.get(f"{live_server}/openapi.json", timeout=10).json()
    ops = {(path, method): op for path, methods in doc["paths"].items() for method, op in methods.items()}
    assert set(ops) == set(OPERATIONS)   # every route has its entry in the table
    ids = Counter(op["operationId"] for op in ops.values())
    assert all(n == 1 for n in ids.values()), ids
    assert ops[("/health", "get")]["operationId"] != ops[("/health", "head")]["operationId"]
    for (path, method), op in ops.items():
        assert "422" not in op["responses"], (path, method)
        for status, response in op["responses"].items():
            if status != "200" and path != "/health":
                assert response["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"}, (path, method, status)
    chat = ops[("/v1/chat/completions", "post")]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(chat)
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionResponse"}
    assert "Retry-After" in chat["429"]["headers"]
    assert set(ops[("/metrics", "get")]["responses"]["200"]["content"]) == {"text/plain"}
    assert "401" not in ops[("/health", "get")]["responses"]   # the probe needs no key
    assert "200" not in ops[("/v1/responses/{response_id}", "get")]["responses"]   # nothing is stored
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and {"ErrorResponse", "ModelList", "ResponseObject"} <= set(schemas)


def test_405_names_the_allowed_methods(live_server):
    for method, path, allow in (("PUT", "/v1/chat/completions", "POST"), ("DELETE", "/health", "GET, HEAD"),
                                ("POST", "/v1/models", "GET"), ("PATCH", "/v1/responses/abc", "DELETE, GET, POST"),
                                ("GET", "/tokenize", "POST")):
        r = httpx.request(method, f"{live_server}{path}", timeout=10)
        err = envelope(r, 405)
        assert r.headers["allow"] == allow and err["code"] == "method_not_allowed" and allow in err["message"]


# ---------------------------------------------------------------------------------------- the log
def test_client_field_names_are_escaped_and_capped_in_the_log(live_server, caplog):
    forged = 'zz\nINFO:     127.0.0.1:1 - "GET /forged HTTP/1.1" 200 OK'
    with caplog.at_level("INFO", logger="unmask.server"):
        assert post(live_server, "/v1/chat/completions",
                    {"messages": [USER], "max_tokens": 1, forged: 1, "y" * 500: 2}).status_code == 200
        assert post(live_server, "/v1/responses", {"input": "hi", "max_output_tokens": 1, forged: 1}).status_code == 200
        assert post(live_server, "/v1/completions",
                    {"prompt": "a", "max_tokens": 1, **{f"extra_{i:02d}": i for i in range(25)}}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignoring unknown request fields")]
    assert len(lines) == 3 and not any("\n" in line for line in lines), lines
    for line in lines[:2]:   # the forged access-log line stays inside the one record, escaped
        assert 'zz\\nINFO:     127.0.0.1:1 - "GET /forged HTTP/1.1" 200 OK' in line
    assert "y" * 64 + "...(+436 chars)" in lines[0] and "y" * 65 not in lines[0]   # names cut at 64 characters
    assert lines[2].endswith("extra_09 (+15 more)")                                 # at most 10 names listed


def test_clean_escapes_control_and_separator_characters():
    from unmask.server.logsafe import clean, names

    assert clean("a\r\nb\tc\x1b[31m\u2028\u202e\\ é") == "a\\r\\nb\\tc\\x1b[31m\\u2028\\u202e\\\\ é"
    assert clean("y" * 70, limit=5) == "yyyyy...(+65 chars)"
    assert names(["a\nb", "c"]) == "a\\nb, c"
