"""Gemma 4's native tool-call syntax (DiffusionGemma inherits Gemma 4's chat template and tokens).

A call is one block of special tokens around a non-JSON body:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,metric:true,hours:[9,12]}<tool_call|>

Objects are `{key:value,...}` with bare keys, strings sit between two `<|"|>` quote tokens (no escapes:
the quote is a token, so any text fits between), numbers / true / false / null are bare, arrays are
`[v,...]`. Results go back inside `<|tool_response>` ... `<tool_response|>`. Syntax as the Gemma 4 chat
template renders it and as public parsers for it read it (vLLM's gemma4 tool parser; mlx-lm's gemma4.py).

This module converts between that syntax and JSON values, and writes the Lark grammar that constrains a
call to a function's JSON Schema (the subset below; anything else is held to a well-formed value).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from unmask.errors import InvalidRequestError

QUOTE = '<|"|>'
CALL_PREFIX = "call:"
_NAME = re.compile(r"call:([^{}\s<]+)\{")


# ---------------------------------------------------------------------------------------- values
def dumps(value: Any) -> str:
    """A JSON value in Gemma 4 syntax (how an assistant message's earlier calls are rendered)."""
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} in Gemma 4 call syntax")


class _Reader:
    """Recursive descent over one body; `partial` tolerates a cut-off end (an unclosed call)."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def value(self) -> Any:
        s = self.s
        if s.startswith(QUOTE, self.i):
            start = self.i + len(QUOTE)
            end = s.find(QUOTE, start)
            if end < 0:
                self.i = len(s)
                return s[start:]
            self.i = end + len(QUOTE)
            return s[start:end]
        if self.i < len(s) and s[self.i] == "{":
            return self.obj()
        if self.i < len(s) and s[self.i] == "[":
            return self.arr()
        j = self.i
        while j < len(s) and s[j] not in ",}]" and not s.startswith(QUOTE, j):
            j += 1
        token, self.i = s[self.i:j].strip(), j
        return _scalar(token)

    def obj(self) -> dict:
        s, out = self.s, {}
        self.i += 1
        while True:
            self._skip(", \n")
            if self.i >= len(s) or s[self.i] == "}":
                self.i += 1
                return out
            colon = s.find(":", self.i)
            if colon < 0:
                self.i = len(s)
                return out
            key = s[self.i:colon].strip()
            if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
                key = key[len(QUOTE):-len(QUOTE)]
            self.i = colon + 1
            out[key] = self.value()

    def arr(self) -> list:
        s, out = self.s, []
        self.i += 1
        while True:
            self._skip(", \n")
            if self.i >= len(s) or s[self.i] == "]":
                self.i += 1
                return out
            out.append(self.value())

    def _skip(self, chars: str) -> None:
        while self.i < len(self.s) and self.s[self.i] in chars:
            self.i += 1


def _scalar(token: str) -> Any:
    if token in ("true", "false"):
        return token == "true"
    if token in ("null", ""):
        return None
    for cast in (int, float):
        try:
            value = cast(token)
        except ValueError:
            continue
        if cast is float and not math.isfinite(value):
            break  # NaN, Infinity, 1e400: JSON has no such number, so the word stays text
        return value
    return token  # an unquoted word: kept as text rather than dropped


def call_name(body: str) -> str | None:
    """The function name once `call:NAME{` has been written, else None."""
    m = _NAME.match(body.lstrip())
    return m.group(1) if m else None


def call_arguments(body: str) -> str | None:
    """The call's arguments as a JSON object text, or None when the body is not `call:NAME{...`."""
    body = body.lstrip()
    m = _NAME.match(body)
    if m is None:
        return None
    reader = _Reader(body)
    reader.i = m.end() - 1
    return json.dumps(reader.obj(), ensure_ascii=False, allow_nan=False)


def format_call(name: str, arguments: dict | str, open_tag: str, close_tag: str) -> str:
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise InvalidRequestError(f"tool call {name!r}: arguments must be a JSON object, got {arguments!r}",
                                  "messages")
    return f"{open_tag}{CALL_PREFIX}{name}{dumps(args)}{close_tag}"


# ---------------------------------------------------------------------------------------- grammar
_INT = r"/-?(0|[1-9][0-9]*)/"
_NUM = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"
# text between two quotes; "<|" is kept out so that a quote written as text ends the string. Where the
# quote is plain text (no special token), body and closing quote are one lexeme: llguidance's lexer does
# not back up a character to end a string that could still go on
_STR_BODY = r"/([^<]|<[^|])*/"
_STR_BODY_QUOTED = r'/([^<]|<[^|])*<\|"\|>/'


class GrammarWriter:
    """Lark rules (llguidance dialect) for Gemma 4 values matching a JSON Schema.

    Covered: type (string, integer, number, boolean, null, object, array, lists of types), enum, const,
    properties with required (declared order; the optional ones may be left out), items, anyOf / oneOf.
    Anything else (string formats and lengths, numeric bounds, $ref, patterns) is held to a well-formed
    value of the declared type, so those keywords are not enforced in this syntax.
    """

    def __init__(self, quote: str):
        self.quote = quote              # the quote as a Lark piece: a special-token id or a literal
        self.special = quote.startswith("<[")
        self.rules: list[str] = []
        self._n = 0
        self._generic: str | None = None

    def rule(self, body: str) -> str:
        self._n += 1
        name = f"g{self._n}"
        self.rules.append(f"{name}: {body}")
        return name

    def string(self) -> str:
        return f"{self.quote} GSTR {self.quote}" if self.special else f"{self.quote} GSTRQ"

    def generic(self) -> str:
        """Any Gemma value (for schemas outside the subset)."""
        if self._generic is None:
            self._generic = "gval"
            self.rules += [
                f"gval: {self.string()} | GNUM | \"true\" | \"false\" | \"null\" | gobj | garr",
                "gobj: \"{\" (GKEY \":\" gval (\",\" GKEY \":\" gval)*)? \"}\"",
                "garr: \"[\" (gval (\",\" gval)*)? \"]\"",
            ]
        return self._generic

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict) or not schema:
            return self.generic()
        if "const" in schema:
            return self.literal(schema["const"])
        if "enum" in schema:
            return self.rule(" | ".join(self.literal(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.rule(" | ".join(self.value(s) for s in schema[key]))
        t = schema.get("type")
        if isinstance(t, list):
            return self.rule(" | ".join(self.value({**schema, "type": x}) for x in t))
        if t == "string":
            return self.rule(self.string())
        if t == "integer":
            return self.rule(_INT)
        if t == "number":
            return self.rule("GNUM")
        if t == "boolean":
            return self.rule('"true" | "false"')
        if t == "null":
            return self.rule('"null"')
        if t == "array":
            item = self.value(schema.get("items", {}))
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        if t == "object" or "properties" in schema:
            return self.object(schema)
        return self.generic()

    def object(self, schema: dict) -> str:
        props = schema.get("properties") or {}
        if not props:
            return self.rule('"{" "}"') if schema.get("additionalProperties") is False else self.generic_object()
        required = set(schema.get("required") or [])
        pairs = [(f"{json.dumps(f'{k}:')} {self.value(v)}", k in required) for k, v in props.items()]
        # rest[j][first]: properties j.. in order, each optional one may be skipped; a comma precedes
        # every property but the first written
        names: dict[tuple[int, bool], str] = {}
        for j in range(len(pairs), -1, -1):
            for first in (True, False):
                if j == len(pairs):
                    names[j, first] = ""
                    continue
                pair, req = pairs[j]
                take = (pair if first else f'"," {pair}') + (f" {names[j + 1, False]}" if names[j + 1, False] else "")
                skip = names[j + 1, first]
                if req:
                    body = take
                else:
                    body = f"{take} | {skip}" if skip else f"({take})?"
                names[j, first] = self.rule(body)
        return self.rule(f'"{{" {names[0, True]} "}}"')

    def generic_object(self) -> str:
        self.generic()
        return "gobj"

    def literal(self, value: Any) -> str:
        if isinstance(value, str) and self.special:
            return f"{self.quote} {json.dumps(value, ensure_ascii=False)} {self.quote}"
        return json.dumps(dumps(value), ensure_ascii=False)

    def terminals(self) -> list[str]:
        return [f"GSTR: {_STR_BODY}", f"GSTRQ: {_STR_BODY_QUOTED}", f"GNUM: {_NUM}", r"GKEY: /[A-Za-z_][A-Za-z0-9_\-]*/"]
