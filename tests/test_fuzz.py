"""Schema-driven fuzzing of the server against its own /openapi.json (schemathesis).

Every operation of the document gets generated requests, valid and invalid, and every answer must be
declared: no 5xx, no status code or content type the document does not list for that operation, and
JSON bodies (answers and error envelopes) that match the schemas it declares. A
second fuzzer varies only the chat history of an otherwise valid request (roles, contents, tool calls with
parts missing or mistyped), which the schema-driven one rarely gets past validation; every method a path
does not declare must answer 405 with `Allow`.

`make test` runs FUZZ_EXAMPLES=15 cases per operation and 4x that per history endpoint (about 360 requests,
20-30 s); `make test-fuzz` runs FUZZ_EXAMPLES=300 (about 7,000). The server is an `unmask serve` subprocess on
the built-in model, with the decoding a request asks for kept cheap: token budgets capped at 4, `n` at 2,
`steps` at 16, so that what is exercised is the request handling. Not a server thread in this process: on
CPython 3.11, two threads building `ast` objects at once can fail with a spurious "AST constructor recursion
depth mismatch" (python/cpython#106905 and reports from langchain and pytest; CI hit it once), and Hypothesis parses source to
describe its strategies while the server's threads parse too (`inspect.signature` of builtins while torch
imports in the embedding loader, traceback carets in 3.11's `format_exc`).

schemathesis' own pytest integration (`schemathesis.pytest.from_fixture`) does not run under pytest 9, so
Hypothesis drives its strategies directly, one test per operation.
"""
from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings  # schemathesis brings hypothesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance)

from test_server import Server
from unmask.defaults import default_model_path
from unmask.server.openapi import OPERATIONS

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))
# no 5xx; every status, content type and declared header as the document says; JSON bodies match its schemas
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
# fields whose size sets the amount of decoding; the fuzzer's values are replaced by small ones
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """`unmask serve` on the built-in model, in its own process; yields its base URL."""
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    server = Server(default_model_path(), log, "--served-model-name", "unmask-tiny", "--max-num-seqs", "4",
                    "--max-queue", "4", "--default-max-tokens", "4")
    try:
        yield server.wait_ready().url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fuzz_schema(live_server):
    return schemathesis.openapi.from_url(f"{live_server}/openapi.json")


def cheapen(body: object) -> None:
    """Cap the fields that set how much a request decodes (in place; other fields keep the fuzzer's values)."""
    if not isinstance(body, dict):
        return
    for name, cap in [(f, 4) for f in TOKEN_FIELDS] + [("n", 2), ("steps", 16)]:
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > cap:
            body[name] = cap


@pytest.mark.parametrize("path, method", sorted(OPERATIONS), ids=lambda x: x)
def test_every_answer_is_declared(fuzz_schema, path, method):
    operation = fuzz_schema[path][method.upper()]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(case):
        cheapen(case.body)
        case.call_and_validate(checks=CHECKS)

    fuzz()


# chat histories: the generic fuzzer rarely gets a whole chat request past validation, so this one varies only
# `messages` (roles, contents, tool calls with missing, extra and mistyped parts) around a valid request
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=6)
FUNCTION = st.fixed_dictionaries({}, optional={"name": st.text(max_size=8) | JSON,
                                               "arguments": st.sampled_from(["{}", '{"a": 1}', "[1]", "x"]) | JSON})
CALL = st.fixed_dictionaries({}, optional={"id": st.text(max_size=8) | JSON, "type": st.just("function") | JSON,
                                           "function": FUNCTION | JSON})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": st.none() | st.text(max_size=20) | st.lists(st.fixed_dictionaries(
                  {"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2),
              "tool_calls": st.lists(CALL, max_size=3), "tool_call_id": st.text(max_size=8),
              "name": st.text(max_size=8)})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_chat_histories_never_break_the_template(live_server, path):
    @given(messages=st.lists(MESSAGE, min_size=1, max_size=5))
    @settings(max_examples=EXAMPLES * 4, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(messages):
        r = httpx.post(f"{live_server}{path}", json={"messages": messages, "max_tokens": 1}, timeout=60)
        assert r.status_code in (200, 400), (messages, r.status_code, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["param"].startswith("messages"), (messages, r.text)

    fuzz()


def test_undeclared_methods_answer_405_with_allow(live_server):
    doc = httpx.get(f"{live_server}/openapi.json", timeout=10).json()
    for path, ops in doc["paths"].items():
        url = live_server + path.replace("{response_id}", "resp_x").replace("{model_id}", "unmask-tiny")
        declared = {m.upper() for m in ops}
        for method in {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"} - declared:
            r = httpx.request(method, url, timeout=10)
            assert r.status_code == 405, (method, path, r.status_code)
            assert set(r.headers["allow"].split(", ")) == declared, (method, path, r.headers["allow"])
            if method != "HEAD":
                assert r.json()["error"]["code"] == "method_not_allowed"
