"""Structured outputs and tool calling (unmask.structured), enforced while decoding.

The models are tiny random checkpoints: unconstrained, their output is garbage, so every parseable,
schema-valid answer below is the enforcement's doing. Engine tests use SDAR (block-causal) and
Dream (bidirectional, shifted logits); the server tests drive a real `unmask serve` process through
the official openai client.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import torch

from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError
from unmask.structured import StructuredSpec, from_request
from unmask.structured.tools import (HERMES, UNMASK, ToolParser, call_grammar, check_tool_choice, check_tools,
                                     fallback_messages, parse_tool_calls)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "ok", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"]}}}
TOOLS = [WEATHER, CLOCK]
REGEX = r"[0-9]{3}-[a-z]{2,5}"
LARK = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'


def checked(kind: str, text: str, value) -> None:
    """Assert that `text` is a complete member of the constraint's language."""
    import re
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    elif kind == "choice":
        assert text in value, text
    else:
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text), text


KINDS = [
    ("json", {"type": "object"}),
    ("json", PERSON),
    ("regex", REGEX),
    ("choice", ("positive", "negative", "neutral")),
    ("grammar", LARK),
]


# ---------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def llms(family_dirs):
    return {name: LLM(family_dirs[name]) for name in ("sdar", "dream")}


def prompt(llm):
    return llm.chat_prompt([{"role": "user", "content": "Answer in the requested format."}])


@pytest.mark.parametrize("family", ["sdar", "dream"])
@pytest.mark.parametrize("kind,value", KINDS, ids=["json_object", "json_schema", "regex", "choice", "grammar"])
def test_every_kind_is_enforced_on_a_random_model(llms, family, kind, value):
    llm = llms[family]
    spec = StructuredSpec(kind, value)
    for seed, policy in ((0, "threshold"), (1, "entropy_bounded"), (2, "low_confidence")):
        params = GenerationParams(max_tokens=96, structured=spec, seed=seed, policy=policy, temperature=1.0)
        out = llm.generate(prompt(llm), params)[0]
        checked(kind, out.text, value)
        assert out.finish_reason in ("stop", "length")


def test_unconstrained_output_is_not_json(llms):
    """The control: without the constraint the same model does not produce the format."""
    llm = llms["sdar"]
    out = llm.generate(prompt(llm), GenerationParams(max_tokens=48, seed=0, temperature=1.0))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("max_tokens", [3, 8, 20])
def test_json_closes_within_max_tokens(llms, max_tokens):
    """A weak model would run a string to max_tokens; the budget rule closes the value in time."""
    llm = llms["sdar"]
    for seed in range(4):
        params = GenerationParams(max_tokens=max_tokens, structured=StructuredSpec.json_object(), seed=seed,
                                  temperature=1.5)
        out = llm.generate(prompt(llm), params)[0]
        assert isinstance(json.loads(out.text), dict), out.text
        assert len(out.token_ids) <= max_tokens and out.finish_reason in ("stop", "length")


def test_regex_closes_within_max_tokens(llms):
    import re

    llm = llms["sdar"]
    email = r"[a-z]+@[a-z]+\.com"
    out = llm.generate(prompt(llm), GenerationParams(max_tokens=16, structured=StructuredSpec("regex", email),
                                                     seed=0, temperature=1.0))[0]
    assert re.fullmatch(email, out.text) and out.finish_reason in ("stop", "length"), out.text


def test_every_committed_token_is_accepted_in_order(llms):
    """Replaying the output (and its stop token) through a fresh matcher accepts every token."""
    llm = llms["sdar"]
    spec = StructuredSpec.json_schema(PERSON)
    seq = llm.engine.add_request(prompt(llm), GenerationParams(max_tokens=96, structured=spec, seed=3,
                                                               temperature=1.0, logprobs=True))
    llm.engine.run_to_completion()
    ids = seq.seq[seq.P:seq.final_end + (1 if seq.finish_reason == "stop" else 0)].tolist()
    fresh = llm.engine.structured_backend().constraint(spec).m
    assert fresh.validate_tokens(ids) == len(ids)
    assert fresh.is_accepting() or fresh.consume_tokens(ids) and fresh.is_accepting()
    assert seq.logprobs is not None and torch.isfinite(seq.logprobs[: seq.num_generated]).all()


def test_forced_bytes_cost_no_forward(llms):
    """A named-tool call is mostly forced text: far more tokens than forwards even on a random model."""
    llm = llms["sdar"]
    grammar = call_grammar(HERMES, check_tools(TOOLS), "get_weather", False, {})
    out = llm.generate(prompt(llm), GenerationParams(max_tokens=96, structured=StructuredSpec("lark", grammar),
                                                     seed=0))[0]
    assert len(out.token_ids) / out.forwards > 2.0


@pytest.mark.parametrize("schema,feature", [
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "object", "properties": {"a": {"not": {}}}}, "not"),   # accepts nothing: said up front
    ({"type": "object", "$dynamicRef": "#x"}, "dynamicRef"),
])
def test_unenforceable_schema_features_are_rejected_by_name(llms, schema, feature):
    with pytest.raises(InvalidRequestError, match=feature) as e:
        llms["sdar"].generate(prompt(llms["sdar"]), GenerationParams(max_tokens=8,
                                                                     structured=StructuredSpec.json_schema(schema)))
    assert e.value.param == "response_format"


def test_bad_regex_and_grammar_are_rejected(llms):
    llm = llms["sdar"]
    for spec in (StructuredSpec("regex", "(", "regex"), StructuredSpec("grammar", "start: nope_rule", "grammar")):
        with pytest.raises(InvalidRequestError) as e:
            llm.engine.check_request([1], GenerationParams(max_tokens=4, structured=spec))
        assert e.value.param == spec.param


def test_structured_rejects_ignore_eos():
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        GenerationParams(structured=StructuredSpec.json_object(), ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="min_tokens"):  # it could ban the only grammatical token
        GenerationParams(structured=StructuredSpec.json_object(), min_tokens=4)


def test_token_table_matches_llguidance_hf_loader(tmp_path):
    """Our byte-level token table and llguidance's own HF loader agree on every token's bytes."""
    import llguidance
    import llguidance.hf

    from unmask.structured.backend import GuidanceBackend
    from unmask.tokenizer import Tokenizer
    from unmask.train.tokenizer import save_hf_tokenizer, train_tokenizer

    texts = ['{"name": "Ada", "age": 36}', "def f(x):\n    return x + 1\n", "héllo wörld — ünïcode ✓"] * 20
    save_hf_tokenizer(train_tokenizer(texts, vocab_size=400, min_frequency=1), tmp_path)
    tok = Tokenizer(tmp_path)
    n = len(tok.hf)
    ours = GuidanceBackend(tok, n, [2, 5]).lltok
    theirs = llguidance.hf.from_tokenizer(tok.hf, n_vocab=n, eos_token=[2, 5])
    for i in range(n):
        assert ours.decode_bytes([i]) == theirs.decode_bytes([i]), i
        assert ours.is_special_token(i) == theirs.is_special_token(i), i


# ---------------------------------------------------------------------------------------- request parsing
def test_response_format_kinds():
    assert from_request({"type": "text"}) is None
    assert from_request({"type": "json_object"}).value == {"type": "object"}
    spec = from_request({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    assert spec.kind == "json" and spec.value == PERSON and spec.param == "response_format.json_schema.schema"
    assert from_request(regex=REGEX).kind == "regex"
    assert from_request(choice=["a", "b"]).value == ("a", "b")
    assert from_request(grammar=LARK).kind == "grammar"
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}}):
        with pytest.raises(InvalidRequestError):
            from_request(bad)
    with pytest.raises(InvalidRequestError, match="only one"):
        from_request({"type": "json_object"}, regex="a")
    with pytest.raises(InvalidRequestError):
        from_request(choice=[])


def test_tool_checks():
    fns = check_tools(TOOLS)
    assert [f["name"] for f in fns] == ["get_weather", "get_time"]
    assert check_tool_choice(None, fns) == ("auto", None)
    assert check_tool_choice("required", fns) == ("required", None)
    assert check_tool_choice({"type": "function", "function": {"name": "get_time"}}, fns) == ("named", "get_time")
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        with pytest.raises(InvalidRequestError):
            check_tool_choice(bad, fns)
    with pytest.raises(InvalidRequestError):
        check_tool_choice("required", [])
    for bad in ([{"type": "function", "function": {"name": "a b"}}], [WEATHER, WEATHER], [{"type": "retrieval"}]):
        with pytest.raises(InvalidRequestError):
            check_tools(bad)


def test_fallback_prompt_and_history():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    out = fallback_messages(msgs, check_tools(TOOLS), UNMASK)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\nYou can call")
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
                                 "</tool_call>")
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n"
                                                  "<tool_response>\nsunny\n</tool_response>"}
    assert len(out) == 4


# ---------------------------------------------------------------------------------------- parsing
OUTPUTS = [
    ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "unit": "c"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', HERMES),
    ('<tool_call>{"name": "get_time", "arguments": {"tz": "<tool_call>"}}</tool_call>', UNMASK),
    ("no calls here, just < and <tool text", UNMASK),
    ('<tool_call>{"name": "get_time", "arguments": 12}</tool_call>trailing', UNMASK),
    ('<tool_call>not json</tool_call>', UNMASK),
]


@pytest.mark.parametrize("text,fmt", OUTPUTS)
def test_streamed_parse_equals_whole_parse(text, fmt):
    content, calls = parse_tool_calls(text, fmt)
    for step in (1, 3, 7):
        parser, got, deltas = ToolParser(fmt), "", []
        for i in range(0, len(text), step):
            c, d = parser.feed(text[i:i + step])
            got, deltas = got + c, deltas + d
        c, d = parser.finish()
        got, deltas = got + c, deltas + d
        assert got == (content or "")
        args: dict[int, str] = {}
        for d in deltas:
            if d.id is not None:  # the first delta of a call: id, name and empty arguments
                assert d.index not in args and d.name and d.arguments == ""
                args[d.index] = ""
            else:
                args[d.index] += d.arguments
        assert [args[i] for i in sorted(args)] == [c.arguments for c in calls]
        assert [c.name for c in parser.calls] == [c.name for c in calls]


def test_parse_results():
    content, calls = parse_tool_calls(OUTPUTS[0][0], HERMES)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris}', "unit": "c"}), ("get_time", {"tz": "UTC"})]
    assert all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls(OUTPUTS[2][0], UNMASK) == ("no calls here, just < and <tool text", [])
    content, calls = parse_tool_calls(OUTPUTS[3][0], UNMASK)
    assert content == "trailing" and calls[0].arguments == "12"
    assert parse_tool_calls(OUTPUTS[4][0], UNMASK) == ("<tool_call>not json</tool_call>", [])
    _, calls = parse_tool_calls(OUTPUTS[0][0], HERMES, parallel=False)
    assert [c.name for c in calls] == ["get_weather"]
    for limit, names in ((1, ["get_weather"]), (2, ["get_weather", "get_time"]), (None, ["get_weather", "get_time"])):
        content, calls = parse_tool_calls(OUTPUTS[0][0], HERMES, max_calls=limit)
        assert [c.name for c in calls] == names and content == "Checking."


def test_pieces_keep_the_order_the_output_wrote():
    text = 'Before.<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>After.'
    for step in (1, 4, len(text)):
        parser, pieces = ToolParser(UNMASK), []
        for i in range(0, len(text), step):
            pieces += parser.feed_pieces(text[i:i + step])
        pieces += parser.finish_pieces()
        kinds = ["text" if isinstance(p, str) else "call" for p in pieces]
        first_call = kinds.index("call")
        assert "".join(p for p in pieces[:first_call] if isinstance(p, str)) == "Before."
        assert "".join(p for p in pieces[first_call:] if isinstance(p, str)) == "After."
        assert "text" not in kinds[first_call:kinds.index("text", first_call)]  # the call's deltas come first
        assert parser.calls[0].complete and parser.calls[0].arguments == '{"tz": "UTC"}'


@pytest.mark.parametrize("text,arguments,complete", [
    ('<tool_call>{"name": "get_time", "arguments', "", False),            # cut off before its arguments
    ('<tool_call>{"name": "get_time", "arguments": {"tz": "U', '{"tz": "U', False),
    ('<tool_call>{"name": "get_time"}</tool_call>', "{}", True),           # closed without arguments: {}
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "{}", True),
])
def test_a_cut_off_call_keeps_what_was_written_and_is_incomplete(text, arguments, complete):
    _, calls = parse_tool_calls(text, UNMASK)
    assert [(c.name, c.arguments, c.complete) for c in calls] == [("get_time", arguments, complete)]


def test_a_stray_close_tag_is_not_content():
    """A call closed twice (the built-in model does this) leaves no `</tool_call>` in the content, streamed
    in any pieces or parsed whole; other text around it stays."""
    text = 'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call></tool_call> Done.</tool_call>'
    for step in (1, 3, len(text)):
        parser, content = ToolParser(UNMASK), ""
        for i in range(0, len(text), step):
            content += parser.feed(text[i:i + step])[0]
        content += parser.finish()[0]
        assert content == "Sure. Done." and [c.name for c in parser.calls] == ["get_time"]
    assert parse_tool_calls("a </tool_call>b", UNMASK) == ("a b", [])
    assert parse_tool_calls("ends with </tool", UNMASK) == ("ends with </tool", [])  # not a whole tag: kept


def test_a_forced_call_cut_off_before_its_name_is_not_content():
    """tool_choice required/named: the grammar allows only calls, so markup cut off before the name (a
    max_tokens too small) is no content either; unforced, the same text is content (it may be prose)."""
    for text in ("<tool_call>", '<tool_call>{"na', 'Hi <tool_call>{"name'):
        plain, _ = parse_tool_calls(text, UNMASK)
        assert plain == text
    for text in ("<to", "<tool_call>", '<tool_call>{"na'):
        assert parse_tool_calls(text, UNMASK, forced=True) == (None, [])
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "argu', UNMASK, forced=True)
    assert [(c.name, c.arguments, c.complete) for c in calls] == [("get_time", "", False)]


# ---------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_server import Server, make_text_checkpoint

    root = tmp_path_factory.mktemp("structured-server")
    srv = Server(make_text_checkpoint(root / "tiny-sdar"), root / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# a whole call either ends by itself ("tool_calls") or is closed by the budget closer ("length", issue 30 item 8:
# the budget ended it); which one a random tiny model gets depends on its rambling, the rule itself is tested on
# the constraint (test_finish_reason_*)
TOOL_ENDINGS = ("tool_calls", "length")


def create(client, **kw):
    return client.chat.completions.create(**{"model": "tiny-sdar", "messages": ASK, "max_tokens": 160, **kw})


def tool_schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def collect_stream(chunks) -> tuple[str, dict[int, dict], list[str]]:
    """(content, calls by index, finish reasons), checking the per-call delta order on the way."""
    content, calls, finishes = "", {}, []
    for ch in chunks:
        if not ch.choices:
            continue
        choice = ch.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:  # first delta of a call: everything but the arguments
                assert tc.id and tc.id.startswith("call_") and tc.type == "function"
                assert tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return content, calls, finishes


def test_response_format_json_schema_and_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = create(client, response_format=fmt, max_tokens=200)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    content, calls, finishes = collect_stream(create(client, response_format=fmt, max_tokens=200, stream=True))
    jsonschema.validate(json.loads(content), PERSON)
    assert calls == {} and len(finishes) == 1
    r = create(client, response_format={"type": "json_object"}, max_tokens=12, n=2, seed=5, temperature=1.0)
    assert all(isinstance(json.loads(c.message.content), dict) for c in r.choices)


def test_regex_choice_grammar_extensions(client):
    r = create(client, extra_body={"regex": REGEX}, max_tokens=16)
    checked("regex", r.choices[0].message.content, REGEX)
    r = create(client, extra_body={"choice": ["positive", "negative"]}, max_tokens=8)
    assert r.choices[0].message.content in ("positive", "negative") and r.choices[0].finish_reason == "stop"
    r = create(client, extra_body={"grammar": LARK}, max_tokens=24)
    checked("grammar", r.choices[0].message.content, LARK)
    r = client.completions.create(model="tiny-sdar", prompt="Code:", max_tokens=16, extra_body={"regex": REGEX})
    checked("regex", r.choices[0].text, REGEX)


def test_tool_choice_required(client):
    r = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    msg, choice = r.choices[0].message, r.choices[0]
    # TOOL_ENDINGS: the random model's arguments may run until the budget closer ends the call ("length")
    assert choice.finish_reason in TOOL_ENDINGS and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), tool_schema(call.function.name))


def test_tool_choice_required_streamed_parallel(client):
    content, calls, finishes = collect_stream(create(client, tools=TOOLS, tool_choice="required", stream=True,
                                                     max_tokens=220, seed=1, temperature=1.0))
    assert content == "" and calls and len(finishes) == 1 and finishes[0] in TOOL_ENDINGS
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), tool_schema(call["name"]))


def test_tool_choice_required_cut_off_by_max_tokens_returns_no_markup(client):
    r = create(client, tools=TOOLS, tool_choice="required", max_tokens=2)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "length" and not msg.content and msg.tool_calls is None
    assert r.usage.completion_tokens == 2
    content, calls, finishes = collect_stream(create(client, tools=TOOLS, tool_choice="required", max_tokens=2,
                                                     stream=True))
    assert content == "" and calls == {} and finishes == ["length"]


def test_tool_choice_named(client):
    for stream in (False, True):
        kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=2)
        if stream:
            _, calls, finishes = collect_stream(create(client, stream=True, **kw))
            calls = list(calls.values())
        else:
            r = create(client, **kw)
            finishes = [r.choices[0].finish_reason]
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in r.choices[0].message.tool_calls]
        assert len(finishes) == 1 and finishes[0] in TOOL_ENDINGS and [c["name"] for c in calls] == ["get_time"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), tool_schema("get_time"))


def test_tool_choice_none_and_auto(client):
    r = create(client, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    r = create(client, tools=TOOLS, max_tokens=12)  # auto: this model never calls; plain content comes back
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    # auto with a response_format: either calls or content in the format
    r = create(client, tools=TOOLS, response_format={"type": "json_object"}, max_tokens=60, seed=3, temperature=1.0)
    msg = r.choices[0].message
    if msg.tool_calls:
        for c in msg.tool_calls:
            jsonschema.validate(json.loads(c.function.arguments), tool_schema(c.function.name))
    else:
        assert isinstance(json.loads(msg.content), dict)


def test_tool_results_in_history(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    r = create(client, messages=history, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason == "length"
    r = create(client, messages=history, max_tokens=8)  # history with calls but no tools offered any more
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema", "not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?!a)b"}}}}}},
     "response_format.json_schema.schema", "look-around"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}},
     "response_format.json_schema.strict", "boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}, "then": {}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "if"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"regex": "("}, "regex", "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar", "grammar"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "only one"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
])
def test_unenforceable_requests_get_400(server, body, param, words):
    import httpx

    for stream in (False, True):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"messages": ASK, "max_tokens": 8, "stream": stream, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err


# ---------------------------------------------------------------------------------------- coverage and JSON hygiene
CORPUS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())


def strictly(schema: dict, strict: bool) -> dict:
    """The schema as a strict request means it (objects with properties closed)."""
    from unmask.structured.schema import strict_objects

    schema = copy.deepcopy(schema)
    if strict:
        strict_objects(schema)
    return schema


def no_duplicates(text: str):
    from unmask.structured.schema import duplicate_key_hook

    return json.loads(text, object_pairs_hook=duplicate_key_hook)  # raises ValueError on a repeated key


def test_corpus_covers_every_keyword_of_the_issue():
    kws = {k for item in CORPUS for k in item["keywords"]}
    assert {"oneOf", "uniqueItems", "not", "format", "dependencies", "propertyNames", "if", "$ref"} <= kws
    assert len(CORPUS) >= 40


@pytest.mark.parametrize("item", CORPUS, ids=[i["name"] for i in CORPUS])
def test_corpus_schema_is_accepted_and_every_answer_is_valid(llms, item):
    """Each real-world-style schema compiles (no 400 up front); an answer that comes back validates against the
    request's schema (strict: closed objects) and repeats no key; a 400 after the draft names the check."""
    import jsonschema

    llm = llms["sdar"]
    spec = StructuredSpec.json_schema(item["schema"], strict=item["strict"])
    llm.engine.structured_backend().compile(spec)
    schema = strictly(item["schema"], item["strict"])
    for seed in range(2):
        try:
            out = llm.generate(prompt(llm), GenerationParams(max_tokens=128, structured=spec, seed=seed,
                                                             temperature=1.0))[0]
        except InvalidRequestError as e:
            assert "after-draft check" in str(e) and e.param == "response_format"
            continue
        if out.finish_reason == "length" and not _complete(out.text):
            continue  # cut off by max_tokens, and said so
        value = no_duplicates(out.text)
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema).validate(value)


def _complete(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_a_check_that_never_passes_is_a_400_after_bounded_attempts(llms):
    from unmask.structured.constraint import ATTEMPTS

    llm = llms["sdar"]
    # a `not` that rewrite.py cannot enforce (no non-integer is an integer): relaxed, checked, never passes
    spec = StructuredSpec.json_schema({"type": "integer", "not": {"type": "integer"}})
    seq = llm.engine.add_request(prompt(llm), GenerationParams(max_tokens=16, structured=spec, seed=0))
    llm.engine.run_to_completion()
    assert seq.constraint.attempts == ATTEMPTS and isinstance(seq.error, InvalidRequestError)
    assert "not" in str(seq.error) and seq.error.param == "response_format"
    with pytest.raises(InvalidRequestError, match="after-draft"):
        llm.generate(prompt(llm), GenerationParams(max_tokens=16, structured=spec, seed=0))
    # one it can enforce turns out empty: said up front, before any decoding
    with pytest.raises(InvalidRequestError, match="Unsatisfiable"):
        llm.generate(prompt(llm), GenerationParams(max_tokens=16, structured=StructuredSpec.json_schema(
            {"type": "boolean", "not": {"type": "boolean"}}), seed=0))


def test_relaxed_schema_output_is_held_back_until_checked(llms):
    """Nothing of a checked answer is released before it passed: one event carries the whole output."""
    llm = llms["sdar"]
    spec = StructuredSpec.json_schema({"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 4,
                                       "uniqueItems": True})
    seq = llm.engine.add_request(prompt(llm), GenerationParams(max_tokens=32, structured=spec, seed=1,
                                                               temperature=1.0))
    events = []
    while llm.engine.has_unfinished():
        events += [o for o in llm.engine.step() if o.request_id == seq.request_id and o.new_token_ids]
    assert seq.error is None and len(events) == 1 and events[0].finished
    value = no_duplicates(llm.tokenizer.decode(events[0].new_token_ids))
    assert len(set(value)) == len(value)


def test_unknown_formats_are_annotations(llms):
    from unmask.structured.schema import prepare

    be = llms["sdar"].engine.structured_backend()
    prep = prepare({"type": "string", "format": "non-blank"}, False, be._schema_error)
    assert prep.enforced == {"type": "string"} and prep.check is None
    prep = prepare({"type": "string", "format": "email"}, False, be._schema_error)  # known: still enforced
    assert prep.enforced["format"] == "email"


@pytest.mark.parametrize("family", ["sdar", "dream"])
def test_no_duplicate_keys(llms, family):
    """Free keys (json_object, additionalProperties) never repeat within an object."""
    llm = llms[family]
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 12}
    # Dream samples every masked row of its 32-token block at each step (SDAR: 4), so its tokens cost more: 48
    # for it, which still writes each answer's first key whole (its keys run long at temperature 1.5: at 96
    # tokens, too, none of its answers reached a second key)
    budget = {"sdar": 96, "dream": 48}[family]
    # a bias towards `"` makes keys short, so answers reach second and third keys and the ban has work to do
    quote = llm.tokenizer.encode('"')
    params = [GenerationParams(max_tokens=budget, structured=spec, seed=seed, temperature=1.5,
                               logit_bias={quote[0]: 6} if len(quote) == 1 else None)
              for seed in range(6) for spec in (StructuredSpec.json_object(), StructuredSpec.json_schema(schema))]
    outs = llm.generate([prompt(llm)] * len(params), params)  # one batch: each request keeps its own seed
    assert len(outs) == 12
    objects = [no_duplicates(out.text) for out in outs]
    assert sum(isinstance(o, dict) and len(o) >= 2 for o in objects) >= 3, [out.text for out in outs]


def test_the_budget_closer_never_repeats_a_key(llms):
    """An answer cut by max_tokens is completed by the budget closer (constraint.closing_path), which obeys the
    guard too. Biased towards `"` and `,`, the random model writes empty keys quickly; before the fix the closer
    closed a half-written key into a second `""` (`{"T none": 5, "": 9, "": 8}` at 24 tokens, seed 4)."""
    llm = llms["sdar"]
    quote, comma = (llm.tokenizer.encode(c) for c in ('"', ","))
    assert len(quote) == len(comma) == 1
    schema = {"type": "object", "additionalProperties": {"type": "integer"}}
    params = [GenerationParams(max_tokens=n, structured=StructuredSpec.json_schema(schema), seed=seed,
                               temperature=1.5, logit_bias={quote[0]: 12, comma[0]: 12})
              for seed in range(6) for n in (24, 32)]
    outs = llm.generate([prompt(llm)] * len(params), params)
    objects = [no_duplicates(out.text) for out in outs]
    assert all(isinstance(o, dict) for o in objects)
    assert sum(out.finish_reason == "length" for out in outs) >= 6   # the closer wrote these answers' ends
    assert sum("" in o and len(o) >= 2 for o in objects) >= 3        # an empty key, then others after it


def test_guard_bans_a_repeated_key_and_runaway_numbers():
    from unmask.structured.guard import MAX_FRAC_DIGITS, MAX_INT_DIGITS, JsonGuard, TokenFacts

    vocab = [b'"', b'":', b'B', b'1', b'12', b'}', b'.', b'x"']
    facts = TokenFacts(vocab)
    g = JsonGuard()
    assert g.feed(b'{"B": 1, "B')
    allowed = g.restrict(torch.ones(len(vocab), dtype=torch.bool), facts)
    assert not allowed[0] and not allowed[1] and allowed[2] and allowed[7]   # `"` would repeat "B"; `x"` would not
    assert not g.copy().feed(b'": 2') and g.copy().feed(b'C": 2')
    g = JsonGuard()
    assert g.feed(b'[' + b'9' * (MAX_INT_DIGITS - 1))
    allowed = g.restrict(torch.ones(len(vocab), dtype=torch.bool), facts)
    assert allowed[3] and not allowed[4] and allowed[6]   # one more digit fits, two do not; the point does
    assert not JsonGuard().feed(b'1.' + b'5' * (MAX_FRAC_DIGITS + 1))
    only_digits = torch.tensor([False, False, False, True, True, False, False, False])
    g = JsonGuard()
    g.feed(b'9' * MAX_INT_DIGITS)
    assert g.restrict(only_digits, facts).equal(only_digits)  # soft: never leaves no token at all


def test_numbers_stay_bounded(llms):
    import re

    from unmask.structured.guard import MAX_EXP_DIGITS, MAX_FRAC_DIGITS, MAX_INT_DIGITS

    llm = llms["sdar"]
    spec = StructuredSpec.json_schema({"type": "array", "items": {"type": "number"}, "maxItems": 3})
    for seed in range(4):
        out = llm.generate(prompt(llm), GenerationParams(max_tokens=160, structured=spec, seed=seed,
                                                         temperature=1.5))[0]
        for m in re.finditer(r"-?(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?", out.text):
            assert len(m.group(1)) <= MAX_INT_DIGITS and len(m.group(2) or "") <= MAX_FRAC_DIGITS
            assert len(m.group(3) or "") <= MAX_EXP_DIGITS, out.text


def test_strict_allows_only_declared_properties(llms):
    llm = llms["sdar"]
    schema = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = from_request({"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": schema}})
    assert spec.strict
    for seed in range(6):
        out = llm.generate(prompt(llm), GenerationParams(max_tokens=48, structured=spec, seed=seed,
                                                         temperature=1.5))[0]
        value = no_duplicates(out.text)
        if isinstance(value, dict):  # no "type": other JSON values are valid too
            assert list(value) == ["a"] and isinstance(value["a"], int), out.text
    loose = from_request({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert not loose.strict and loose.key != spec.key


def test_finish_reason_is_length_when_the_budget_ended_the_output(llms):
    llm = llms["sdar"]
    seen = set()
    for max_tokens in (4, 8, 12):
        for seed in range(4):
            seq = llm.engine.add_request(prompt(llm), GenerationParams(
                max_tokens=max_tokens, structured=StructuredSpec.json_object(), seed=seed, temperature=1.5))
            llm.engine.run_to_completion()
            text = llm.tokenizer.decode(seq.output_ids)
            assert isinstance(json.loads(text), dict), text
            if seq.constraint.budget_cut or seq.num_generated == max_tokens and not seq.constraint.m.is_stopped():
                assert seq.finish_reason == "length", (text, seq.finish_reason)
            else:
                assert seq.finish_reason == "stop"
            seen.add(seq.finish_reason)
    assert seen == {"stop", "length"}
