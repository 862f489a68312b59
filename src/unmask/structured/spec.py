"""What a request constrains its output to, before any grammar engine is involved.

`StructuredSpec` is a small immutable value carried by `GenerationParams`; it imports nothing heavy,
so the engine's parameter module stays light. `unmask.structured.backend` compiles it to an
llguidance grammar. Kinds:

  json       JSON Schema (`value`: the schema as a dict); `{"type": "object"}` is OpenAI's json_object
  regex      a regular expression the whole output must match (Rust `regex` syntax)
  choice     the output is exactly one of a list of strings
  grammar    a Lark grammar (llguidance's dialect: `start:` rule, `%json`, regex terminals)
  lark       internal: a finished llguidance Lark grammar (tool calls and unions are built as one)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from unmask.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "lark")

# JSON is generated with fixed separators and no free whitespace: `{"a": 1, "b": [2, 3]}` (what
# json.dumps writes and what chat models are trained on). Free whitespace would let a weak model
# pad forever, and fixed separators are forced bytes that cost no forward (see constraint.py).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    value: Any      # dict (json), str (regex, grammar, lark) or tuple[str, ...] (choice)
    param: str = "response_format"   # the request field a compile error is reported against
    strict: bool = False   # json: OpenAI strict mode (objects with declared properties allow only those)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown structured-output kind {self.kind!r}; one of {', '.join(KINDS)}",
                                      self.param)
        if self.kind == "json" and not isinstance(self.value, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be an object", self.param)
        if self.kind in ("regex", "grammar", "lark") and (not isinstance(self.value, str) or not self.value):
            raise InvalidRequestError(f"{self.param} must be a non-empty string", self.param)
        if self.kind == "choice":
            if (not isinstance(self.value, (list, tuple)) or not self.value
                    or not all(isinstance(c, str) and c for c in self.value)):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings", self.param)
            object.__setattr__(self, "value", tuple(self.value))

    @property
    def key(self) -> str:
        """A stable text key (compile cache)."""
        return json.dumps([self.kind, self.value, self.strict], sort_keys=True, ensure_ascii=False)

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def json_object() -> StructuredSpec:
        return StructuredSpec("json", {"type": "object"})

    @staticmethod
    def json_schema(schema: dict, param: str = "response_format", strict: bool = False) -> StructuredSpec:
        return StructuredSpec("json", schema, param, strict)


def from_response_format(fmt: dict | None) -> StructuredSpec | None:
    """OpenAI `response_format`: text (None), json_object, or json_schema {name, schema, strict}.

    `strict: false` is still enforced: a schema that was sent is a schema that holds. `strict: true` also closes
    objects that declare properties and leave `additionalProperties` unset (OpenAI's strict mode; see schema.py).
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("response_format must be an object", "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError("response_format.json_schema must be an object with a `schema`",
                                      "response_format.json_schema")
        schema = js.get("schema", {})  # OpenAI treats a missing schema as "any JSON"
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON object",
                                      "response_format.json_schema.schema")
        strict = js.get("strict")
        strict = False if strict is None else strict
        if not isinstance(strict, bool):
            raise InvalidRequestError("response_format.json_schema.strict must be a boolean",
                                      "response_format.json_schema.strict")
        return StructuredSpec.json_schema(schema or {"type": "object"}, "response_format.json_schema.schema", strict)
    raise InvalidRequestError(f"response_format type {kind!r} is not supported; use text, json_object or "
                              "json_schema (or the regex, choice and grammar fields)", "response_format")


def from_request(response_format: dict | None = None, regex: str | None = None, choice: list[str] | None = None,
                 grammar: str | None = None) -> StructuredSpec | None:
    """The one constraint a request asks for; asking for two is an error (they would have to intersect)."""
    specs = [s for s in (
        from_response_format(response_format),
        StructuredSpec("regex", regex, "regex") if regex is not None else None,
        StructuredSpec("choice", choice, "choice") if choice is not None else None,
        StructuredSpec("grammar", grammar, "grammar") if grammar is not None else None,
    ) if s is not None]
    if len(specs) > 1:
        names = ", ".join(s.param.split(".")[0] for s in specs)
        raise InvalidRequestError(f"only one output constraint per request; got {names}", specs[1].param)
    return specs[0] if specs else None


def styled_schema(schema: dict | bool, coerce_one_of: bool = False) -> dict | bool:
    """The schema with unmask's JSON output style as llguidance's `x-guidance` options.

    A client's own `x-guidance` is replaced, not merged: its `lenient` option would turn unsupported
    keywords into silently unenforced ones. `coerce_one_of` is set only by `schema.prepare`, which then
    checks "exactly one branch" after the draft.
    """
    if isinstance(schema, bool):
        return schema
    style = {**JSON_STYLE, "coerce_one_of": True} if coerce_one_of else dict(JSON_STYLE)
    return {**schema, "x-guidance": style}
