"""Gemma 4 tool-call syntax (DiffusionGemma): parsing, rendering, streaming and the call grammar."""
from __future__ import annotations

import json

import pytest

from unmask.structured import gemma4
from unmask.structured.tools import (GEMMA4, ToolParser, call_grammar, fallback_messages, format_call,
                                     history_as_text, parse_tool_calls, special_tags, tool_format)

Q = gemma4.QUOTE
WEATHER = {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
                   "hours": {"type": "array", "items": {"type": "number"}}, "metric": {"type": "boolean"}},
    "required": ["city", "unit"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                            "required": ["tz"]}}

CALL_1 = f"<|tool_call>call:get_weather{{city:{Q}Paris, {{France}}{Q},days:3,unit:{Q}c{Q},hours:[9,12.5],metric:true}}<tool_call|>"
CALL_2 = f"<|tool_call>call:get_time{{tz:{Q}UTC{Q}}}<tool_call|>"
OUTPUTS = [
    "Let me check." + CALL_1 + CALL_2,
    CALL_2,
    "plain answer with a < and a {brace}",
    "<|tool_call>no call prefix<tool_call|>",
    f"<|tool_call>call:get_time{{tz:{Q}UT",  # cut off by max_tokens
]


def test_non_finite_numbers_stay_text_so_the_arguments_are_json():
    _, calls = parse_tool_calls("<|tool_call>call:f{d:NaN,e:Infinity,g:1e400,h:2.5}<tool_call|>", GEMMA4)
    assert json.loads(calls[0].arguments) == {"d": "NaN", "e": "Infinity", "g": "1e400", "h": 2.5}
    assert "NaN" not in calls[0].arguments.replace('"NaN"', "")   # strict JSON: no bare NaN


def test_family_uses_the_gemma4_format():
    assert tool_format("diffusion_gemma") is GEMMA4
    assert tool_format("sdar") is not GEMMA4


def test_parse_converts_arguments_to_json():
    content, calls = parse_tool_calls(OUTPUTS[0], GEMMA4)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris, {France}", "days": 3, "unit": "c", "hours": [9, 12.5], "metric": True}),
        ("get_time", {"tz": "UTC"})]
    assert parse_tool_calls(OUTPUTS[2], GEMMA4) == ("plain answer with a < and a {brace}", [])
    assert parse_tool_calls(OUTPUTS[3], GEMMA4) == ("<|tool_call>no call prefix<tool_call|>", [])
    # an unclosed (cut-off) call keeps its name but no converted arguments: `tz:<|"|>UT` is not {"tz": "UT"}
    _, calls = parse_tool_calls(OUTPUTS[4], GEMMA4)
    assert [(c.name, c.arguments, c.complete) for c in calls] == [("get_time", "", False)]
    _, calls = parse_tool_calls("<|tool_call>call:f{a:1,b:", GEMMA4)
    assert [(c.name, c.arguments) for c in calls] == [("f", "")]
    _, calls = parse_tool_calls(OUTPUTS[0], GEMMA4, parallel=False)
    assert [c.name for c in calls] == ["get_weather"]


def test_values_nested_null_and_bare_words():
    body = f"call:f{{a:{{b:[{Q}x,y{Q},null,false,-2e3]}},c:word,d:}}"
    assert json.loads(gemma4.call_arguments(body)) == {"a": {"b": ["x,y", None, False, -2000.0]}, "c": "word",
                                                       "d": None}
    assert gemma4.call_name("call:f{") == "f" and gemma4.call_name("call:f") is None
    assert gemma4.call_arguments("not a call") is None


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_parse_equals_whole_parse(text):
    from test_structured import test_streamed_parse_equals_whole_parse as same_as_whole  # the hermes check

    same_as_whole(text, GEMMA4)


def test_rendered_history_round_trips():
    args = {"city": "Oslo", "days": 2, "unit": "f", "hours": [1.5], "metric": False}
    text = format_call(GEMMA4, {"function": {"name": "get_weather", "arguments": json.dumps(args)}})
    assert text == (f"<|tool_call>call:get_weather{{city:{Q}Oslo{Q},days:2,unit:{Q}f{Q},hours:[1.5],"
                    f"metric:false}}<tool_call|>")
    _, calls = parse_tool_calls(text, GEMMA4)
    assert json.loads(calls[0].arguments) == args
    msgs = history_as_text([
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}], GEMMA4)
    assert msgs == [{"role": "assistant", "content": CALL_2},
                    {"role": "user", "content": "<|tool_response>\n12:00\n<tool_response|>"}]
    system = fallback_messages([{"role": "user", "content": "hi"}], [CLOCK], GEMMA4)[0]["content"]
    assert "<|tool_call>call:<tool name>{key:value,...}<tool_call|>" in system and Q in system


@pytest.fixture(scope="module")
def gemma_tokenizer(tmp_path_factory):
    """The built-in tokenizer plus Gemma 4's tool tokens as special tokens (as in the real vocabulary)."""
    from tokenizers import AddedToken, Tokenizer as RawTokenizer

    from unmask.defaults import default_model_path
    from unmask.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("gemma-tok")
    src = default_model_path()
    raw = RawTokenizer.from_file(str(src / "tokenizer.json"))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|tool_call>", "<tool_call|>", Q)])
    raw.save(str(out / "tokenizer.json"))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer(out)


def _accepts(backend, grammar: str, text: str, tok) -> bool:
    import llguidance

    m = llguidance.LLMatcher(backend.lltok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok.hf(text, add_special_tokens=False)["input_ids"]
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_call_grammar_enforces_names_types_and_required_keys(gemma_tokenizer):
    from unmask.structured.backend import GuidanceBackend

    tok = gemma_tokenizer
    special = special_tags(tok, GEMMA4)
    assert set(special) == {"<|tool_call>", "<tool_call|>", Q}
    backend = GuidanceBackend(tok, len(tok.hf), [tok.hf.eos_token_id])
    any_call = call_grammar(GEMMA4, [WEATHER, CLOCK], None, True, special)
    good = [CALL_1 + CALL_2, CALL_2, f"<|tool_call>call:get_weather{{city:{Q}Rome{Q},unit:{Q}f{Q}}}<tool_call|>"]
    bad = [
        f"<|tool_call>call:get_weather{{city:{Q}Rome{Q}}}<tool_call|>",                       # unit required
        f"<|tool_call>call:get_weather{{city:{Q}Rome{Q},unit:{Q}k{Q}}}<tool_call|>",          # not in enum
        f"<|tool_call>call:get_weather{{city:{Q}Rome{Q},days:2.5,unit:{Q}c{Q}}}<tool_call|>",  # not an integer
        f"<|tool_call>call:get_weather{{unit:{Q}c{Q},city:{Q}Rome{Q}}}<tool_call|>",          # declared order
        f"<|tool_call>call:get_date{{tz:{Q}UTC{Q}}}<tool_call|>",                              # unknown function
        CALL_2.replace("<|tool_call>", "<|tool_call> "),
    ]
    for text in good:
        assert _accepts(backend, any_call, text, tok), text
    for text in bad:
        assert not _accepts(backend, any_call, text, tok), text
    named = call_grammar(GEMMA4, [WEATHER, CLOCK], "get_time", False, special)
    assert _accepts(backend, named, CALL_2, tok)
    assert not _accepts(backend, named, CALL_1, tok) and not _accepts(backend, named, CALL_2 + CALL_2, tok)


def test_call_grammar_with_tags_as_plain_text():
    """A tokenizer without Gemma's special tokens: tags and quotes are matched as text."""
    from unmask.defaults import default_model_path
    from unmask.structured.backend import GuidanceBackend
    from unmask.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    assert special_tags(tok, GEMMA4) == {}
    backend = GuidanceBackend(tok, len(tok.hf), [tok.hf.eos_token_id])
    grammar = call_grammar(GEMMA4, [WEATHER, CLOCK], None, True, {})
    assert _accepts(backend, grammar, CALL_1 + CALL_2, tok)
    assert not _accepts(backend, grammar, CALL_2.replace("UTC", "U<|TC"), tok)  # "<|" cannot sit in a string


def test_chat_plan_for_diffusion_gemma_parses_gemma4_calls():
    from unmask.structured.tools import plan_chat

    tools = [{"type": "function", "function": CLOCK}]
    msgs = [{"role": "user", "content": "time?"}]
    plan = plan_chat(msgs, tools, "auto", None, None, "diffusion_gemma", True, {})
    assert plan.parse is GEMMA4 and plan.structured is None and plan.template_tools == tools
    plan = plan_chat(msgs, tools, {"type": "function", "function": {"name": "get_time"}}, None, None,
                     "diffusion_gemma", False, {})
    assert plan.structured.kind == "lark" and '"call:get_time"' in plan.structured.value
    assert "<|tool_call>call:<tool name>" in plan.messages[0]["content"]  # fallback prompt in Gemma syntax


def test_history_arguments_reach_templates_as_objects():
    from unmask.server.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    msg = ChatMessage(role="assistant", content=None, tool_calls=[call]).to_template()
    assert msg["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert call["function"]["arguments"] == '{"tz": "UTC"}'  # the request itself is not modified
    odd = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    assert ChatMessage(role="assistant", tool_calls=[odd]).to_template()["tool_calls"][0] == odd


def test_history_with_unreadable_arguments_is_a_request_error():
    from unmask.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="arguments must be a JSON object"):
        format_call(GEMMA4, {"function": {"name": "f", "arguments": "[1, 2"}})
