"""Schema rewrites (unmask.structured.rewrite): keywords llguidance does not implement, enforced in the grammar.

Each rewrite is checked three ways: its exact shape; soundness and exactness against jsonschema on sample
values (the rewritten schema admits exactly what the original admits, never more); and, for the corpus
forms, that llguidance compiles the rewritten schema and its grammar accepts and refuses what it should.
The JSON guard's uniqueItems ban is checked on bytes and on token masks.
"""
from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import torch

from unmask.structured.negate import negate, other_strings
from unmask.structured.rewrite import rewrite, unique_paths


def ok(schema, value) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema).is_valid(value)


ENUM_NAME = {"type": "string", "maxLength": 12, "not": {"enum": ["admin", "root"]}}
COUNTRY = {"type": "object", "properties": {"country": {"enum": ["US", "CA"]}, "zip": {"type": "string"}},
           "required": ["zip"], "additionalProperties": False,
           "if": {"properties": {"country": {"const": "US"}}},
           "then": {"properties": {"zip": {"pattern": "^[0-9]{5}$"}}},
           "else": {"properties": {"zip": {"pattern": "^[A-Z][0-9]$"}}}}
CASES = [  # (name, schema, the keywords rewritten, sample values)
    ("not-type", {"type": ["string", "null"], "not": {"type": "null"}}, ["not"], ["a", None, 1, ""]),
    ("not-number", {"not": {"type": "number"}}, ["not"], [1, 1.5, "a", None, [], {}, True]),
    ("not-const-empty", {"type": "string", "not": {"const": ""}}, ["not"], ["", "a", " "]),
    ("not-enum-strings", ENUM_NAME, ["not"],
     ["admin", "root", "adm", "admins", "roo", "rooted", "", "bob", "x" * 12, "x" * 13, "ad\nmin"]),
    ("not-enum-in-enum", {"enum": ["a", "b", 1], "not": {"enum": ["a", 1.0]}}, ["not"], ["a", "b", 1, 1.0, "c"]),
    ("not-required", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "not": {"required": ["a", "b"]}}, ["not"],
     [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}]),
    ("not-integer", {"type": "number", "minimum": 0, "maximum": 2, "not": {"type": "integer"}}, ["not"],
     [0, 0.5, 1, 1.0, 1.25, 2, 2.5, -0.5]),
    ("if-then-else", COUNTRY, ["if"],
     [{"country": "US", "zip": "12345"}, {"country": "US", "zip": "A1"}, {"country": "CA", "zip": "A1"},
      {"country": "CA", "zip": "12345"}, {"zip": "12345"}, {"zip": "A1"}]),
    ("if-then-required", {"type": "object", "properties": {"kind": {"enum": ["file", "url"]}}, "required": ["kind"],
                          "if": {"properties": {"kind": {"const": "file"}}}, "then": {"required": ["path"]},
                          "else": {"required": ["url"]}}, ["if"],
     [{"kind": "file", "path": "a"}, {"kind": "file", "url": "a"}, {"kind": "url", "url": "a"}, {"kind": "url"}]),
    ("dependentRequired", {"type": "object", "dependentRequired": {"min": ["max"], "max": ["min"]}},
     ["dependentRequired"], [{}, {"min": 1}, {"max": 1}, {"min": 1, "max": 2}, {"other": 1}]),
    ("dependentSchemas", {"type": "object", "properties": {"proxy": {"type": "boolean"}},
                          "dependentSchemas": {"url": {"properties": {"proxy": {"const": True}},
                                                       "required": ["proxy"]}}}, ["dependentSchemas"],
     [{}, {"url": "x"}, {"proxy": True, "url": "x"}, {"proxy": False, "url": "x"}, {"proxy": False}]),  # llguidance:
    # declared properties come first
    ("propertyNames-pattern", {"type": "object", "propertyNames": {"pattern": "^[A-Z_]{1,4}$"},
                               "additionalProperties": {"type": "string"}}, ["propertyNames"],
     [{}, {"AB": "x"}, {"ab": "x"}, {"AB": 1}, {"ABCDE": "x"}]),
    ("propertyNames-declared", {"type": "object", "properties": {"ok": {}, "Bad": {}},
                                "propertyNames": {"maxLength": 2}}, ["propertyNames"],
     [{"ok": 1}, {"Bad": 1}, {"xy": 1}, {"xyz": 1}]),
    ("maxProperties-open", {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x"]}},
                            "required": ["a"], "maxProperties": 2}, ["maxProperties"],
     [{"a": True}, {"a": True, "b": "x"}, {"a": True, "c": 1}, {"a": True, "b": "x", "c": 1}, {"a": True, "b": 1}]),
    ("uniqueItems-trivial", {"type": "array", "maxItems": 1, "uniqueItems": True}, ["uniqueItems"], [[], [1], [1, 1]]),
]


@pytest.mark.parametrize("name,schema,keywords,samples", CASES, ids=[c[0] for c in CASES])
def test_rewrite_is_exact(name, schema, keywords, samples):
    """The rewritten schema no longer has the keyword and admits exactly the sample values the original does."""
    out = copy.deepcopy(schema)
    assert rewrite(out) == keywords
    text = json.dumps(out)
    for k in keywords:
        if k not in ("maxProperties",):
            assert f'"{k}"' not in text, text
    for v in samples:
        assert ok(out, v) == ok(schema, v), (v, out)


def test_not_enum_pattern_is_the_complement():
    rx = re.compile(other_strings(["admin", "root", "ro"]))
    for w in ("admin", "root", "ro"):
        assert not rx.search(w)
    for w in ("", "a", "adm", "admins", "r", "roo", "rooted", "x.y", "ad\nmin", "Root"):
        assert rx.search(w), w


def test_negate_gives_up_where_no_exact_form_is_known():
    assert negate({"type": "integer"}, {"type": "number"}) is None            # unbounded: infinitely many gaps
    assert negate({"type": "integer"}, {"type": "number", "minimum": 0, "maximum": 1e6}) is None   # too many
    assert negate({"pattern": "^a"}, {"type": "string"}) is None
    assert negate({"enum": ["a"]}, {"type": "string", "pattern": "^[a-z]+$"}) is None   # no intersection of patterns
    assert negate({"required": ["a"]}, {"required": ["a"]}) is None          # `not` of something always true
    s = {"type": "number", "not": {"type": "integer"}}
    assert rewrite(s) == [] and "not" in s                                    # left for the after-draft check
    s = {"if": {"pattern": "^a"}, "then": {"maxLength": 3}}
    assert rewrite(s) == [] and "if" in s


def test_uniqueItems_over_a_finite_set_is_capped_and_scalar_paths_found():
    s = {"type": "object", "properties": {
        "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "uniqueItems": True, "maxItems": 9},
        "flags": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
        "objs": {"type": "array", "items": {"type": "object"}, "uniqueItems": True},
        "nested": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}
    assert unique_paths(s) == {("days",): ("mon", "tue", "wed"), ("flags",): (True, False),
                               ("nested", "*"): None}                            # not the array of objects
    rewrite(s)
    assert s["properties"]["days"]["maxItems"] == 3 and s["properties"]["flags"]["maxItems"] == 2
    assert s["properties"]["days"]["uniqueItems"] is True     # distinctness: guard and after-draft check


def test_ref_siblings_are_merged_into_a_copy_of_the_definition():
    tree = {"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["name"],
                               "properties": {"name": {"type": "string"},
                                              "kids": {"type": "array", "items": {"$ref": "#/$defs/node",
                                                                                  "maxProperties": 2,
                                                                                  "required": ["kids"]}}}}},
            "$ref": "#/$defs/node"}
    out = copy.deepcopy(tree)
    assert rewrite(out) == ["$ref"]
    node, copy1 = out["$defs"]["node"], out["$defs"]["node__1"]
    assert node["properties"]["kids"]["items"] == {"$ref": "#/$defs/node__1"}
    assert copy1["properties"]["kids"]["items"] == {"$ref": "#/$defs/node__1"}     # the copy refers to itself
    assert copy1["required"] == ["name", "kids"] and "maxProperties" not in copy1  # closed, 2 properties: redundant
    for v in ({"name": "a"}, {"name": "a", "kids": [{"name": "b"}]}, {"name": "a", "kids": [{"name": "b", "kids": []}]},
              {"name": "a", "kids": [{"name": "b", "kids": [{"name": "c"}]}]}):
        assert ok(out, v) == ok(tree, v), v
    # siblings that read the target's own keywords (additionalProperties vs properties) are not merged
    odd = {"$defs": {"x": {"type": "object", "additionalProperties": False,
                           "properties": {"y": {"$ref": "#/$defs/x", "properties": {"z": {}}}}}}, "$ref": "#/$defs/x"}
    assert "$ref" not in rewrite(odd)


# ------------------------------------------------------------------------------------------ enforced by llguidance
@pytest.fixture(scope="module")
def backend(family_dirs):
    from unmask.engine.llm import LLM

    return LLM(family_dirs["sdar"]).engine.structured_backend()


def grammar_accepts(backend, schema, value) -> bool:
    import llguidance

    from unmask.structured.spec import styled_schema

    M = llguidance.LLMatcher
    m = M(backend.lltok, M.grammar_from_json_schema(styled_schema(schema)), log_level=0)
    ids = backend.tok.encode(json.dumps(value))
    return bool(m.consume_tokens(ids)) and m.is_accepting() and not m.is_error()


@pytest.mark.parametrize("name,schema,keywords,samples", CASES, ids=[c[0] for c in CASES])
def test_llguidance_enforces_the_rewrite(backend, name, schema, keywords, samples):
    """prepare() compiles the rewritten schema, and its grammar admits a sample exactly when the original does."""
    from unmask.structured.schema import prepare

    prep = prepare(schema, False, backend._schema_error)
    assert set(keywords) <= set(prep.rewritten) and not set(keywords) & set(prep.relaxed)
    assert prep.check is not None     # the after-draft check stays as the safety net
    for v in samples:
        assert grammar_accepts(backend, prep.enforced, v) == ok(schema, v), (v, prep.enforced)


def test_ref_siblings_compile(backend):
    from unmask.structured.schema import prepare

    menu = {"definitions": {"item": {"type": "object", "additionalProperties": False, "required": ["label"],
                                     "properties": {"label": {"type": "string", "maxLength": 10},
                                                    "submenu": {"$ref": "#/definitions/item", "required": ["label"]}}}},
            "$ref": "#/definitions/item"}
    prep = prepare(menu, False, backend._schema_error)
    assert prep.rewritten == ("$ref",) and not prep.relaxed
    for v in ({"label": "a"}, {"label": "a", "submenu": {"label": "b"}}, {"label": "a", "submenu": {}},
              {"label": "a", "submenu": {"label": "b", "submenu": {"label": "c"}}}):
        assert grammar_accepts(backend, prep.enforced, v) == ok(menu, v), v


# ------------------------------------------------------------------------------------------ the guard's uniqueItems
def test_guard_keeps_unique_arrays_distinct():
    from unmask.structured.guard import JsonGuard, TokenFacts

    g = JsonGuard(frozenset({("days",), ("ids",), ("m", "*")}))
    assert g.feed(b'{"days": ["mon", "tue"')
    assert not g.copy().feed(b', "mon"') and g.copy().feed(b', "wed"') and g.copy().feed(b', "mond"')
    assert g.feed(b'], "other": [1, 1], "ids": [1, 20')      # "other" is not a unique path
    assert not g.copy().feed(b', 1]') and not g.copy().feed(b', 1.0]') and not g.copy().feed(b', 20, ')
    assert g.copy().feed(b', 12]') and g.copy().feed(b', 2]')
    assert g.feed(b'], "m": [[true, false], [true')             # per array: the second list starts afresh
    assert not g.copy().feed(b', true]') and g.copy().feed(b', false]')
    vocab = [b', ', b']', b'0', b'1', b' "mon"', b'"', b'mon"', b'x"', b'tue']
    facts = TokenFacts(vocab)
    every = torch.ones(len(vocab), dtype=torch.bool)
    g = JsonGuard(frozenset({("ids",)}))
    g.feed(b'{"ids": [10, 1')
    assert g.restrict(every, facts).tolist() == [True, True, True, True, True, True, True, True, True]  # 1 is new
    g.feed(b'0')                       # "10" again: every token that would end it here is banned, digits are not
    assert g.restrict(every, facts).tolist() == [False, False, True, True, False, False, False, False, True]
    g = JsonGuard(frozenset({("days",)}))
    g.feed(b'{"days": ["mon", ')
    allowed = g.restrict(every, facts)
    assert not allowed[4] and allowed[5]                          # ` "mon"` would repeat; an open quote need not
    g.feed(b'"')
    allowed = g.restrict(every, facts)
    assert not allowed[6] and allowed[7] and allowed[8]           # `mon"` closes a repeat; `x"` and `tue` do not


def test_guard_bans_the_start_of_a_forced_repeat():
    """Over an enum, `"m` can only become "mon": once "mon" is in the array, `"m` is banned (the grammar would force
    the rest of it without a look at the guard)."""
    from unmask.structured.guard import JsonGuard, TokenFacts

    days = {("days",): ("mon", "tue", "thu"), ("n",): (1, 2, 10), ("b",): (True, False)}
    g = JsonGuard(days)
    assert g.feed(b'{"days": ["mon", ')
    assert not g.copy().feed(b'"m') and g.copy().feed(b'"t') and g.copy().feed(b'"th')
    assert g.feed(b'"tue", "')
    assert g.copy().feed(b't') and not g.copy().feed(b'tu') and g.copy().feed(b'thu"')   # "t" may still be thu
    vocab = [b'mon"', b'tu', b'th', b'thu"', b'x']
    facts = TokenFacts(vocab)
    every = torch.ones(len(vocab), dtype=torch.bool)
    assert g.restrict(every, facts).tolist() == [False, False, True, True, False]
    g = JsonGuard(days)
    assert g.feed(b'{"n": [1, 2, ') and not g.copy().feed(b'2') and g.copy().feed(b'10]') and not g.copy().feed(b'3')
    assert g.feed(b'10], "b": [true, ') and not g.copy().feed(b't') and g.copy().feed(b'false]')


def test_oneOf_is_made_disjoint_where_the_branches_can_be_negated(backend):
    from unmask.structured.rewrite import rewrite_one_of
    from unmask.structured.schema import prepare

    schema = {"type": "object", "properties": {"path": {"type": "string"}, "url": {"type": "string"}},
              "additionalProperties": False, "oneOf": [{"required": ["path"]}, {"required": ["url"]}]}
    samples = [{}, {"path": "a"}, {"url": "b"}, {"path": "a", "url": "b"}]
    out = copy.deepcopy(schema)
    assert rewrite_one_of(out) and "oneOf" not in out
    assert out["anyOf"] == [{"allOf": [{"required": ["path"]}, {"properties": {"url": False}}]},
                            {"allOf": [{"required": ["url"]}, {"properties": {"path": False}}]}]
    prep = prepare(schema, False, backend._schema_error)
    assert prep.rewritten == ("oneOf",) and not prep.relaxed and not prep.coerce_one_of and prep.check is not None
    for v in samples:
        assert ok(out, v) == ok(schema, v) == grammar_accepts(backend, prep.enforced, v), v
    # branches llguidance tells apart itself: untouched
    assert prepare({"oneOf": [{"type": "string"}, {"type": "integer"}]}, False, backend._schema_error).rewritten == ()
    # an integer is also a multiple of 0.5, and "not an integer" has no form on an unbounded number: coerced, checked
    halves = {"oneOf": [{"type": "integer"}, {"type": "number", "multipleOf": 0.5}]}
    prep = prepare(halves, False, backend._schema_error)
    assert prep.relaxed == ("oneOf",) and prep.coerce_one_of


@pytest.mark.parametrize("schema", [
    {"not": {"required": [{"a": 1}]}},
    {"type": "object", "dependentRequired": {"a": [{}]}},
    {"type": "object", "required": [[1]], "maxProperties": 1, "properties": {"a": {}}},
    {"type": "string", "not": {"enum": ["x" * 2000]}},
    {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": 5},
    {"type": "object", "propertyNames": {"pattern": "("}},
    {"$defs": {"a": {"type": "object"}}, "properties": {"x": {"$ref": "#/$defs/a", "required": [{}]}}},
    {"type": "array", "items": {"enum": [[1], {"a": 1}, 1]}, "uniqueItems": True},
    {"oneOf": [{"required": ["a"]}, {"required": "b"}]},
])
def test_malformed_schemas_are_a_400_or_accepted_never_a_crash(backend, schema):
    from unmask.errors import InvalidRequestError
    from unmask.structured.schema import prepare

    try:
        prep = prepare(schema, False, backend._schema_error)
    except InvalidRequestError as e:
        assert str(e)
    else:
        assert prep.enforced is not None


def test_guard_over_a_small_integer_range_bans_a_number_that_can_only_repeat():
    """0..99: after "83", "8" may go on ("8", "80".."89"), but "83" can only end (nothing follows it under 99), and
    ending it is banned, so the "3" that would leave no way out is banned already."""
    from unmask.structured.guard import JsonGuard
    from unmask.structured.rewrite import int_range

    assert int_range({"type": "integer", "minimum": 0.5, "exclusiveMaximum": 4}) == [1, 2, 3]
    assert int_range({"type": "integer", "minimum": 0}) is None and int_range({"type": "number", "maximum": 1}) is None
    schema = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True,
                                                       "items": {"type": "integer", "minimum": 0, "maximum": 99}}}}
    paths = unique_paths(schema)
    assert paths == {("ids",): tuple(range(100))}
    g = JsonGuard(paths)
    assert g.feed(b'{"ids": [83, 8')
    assert not g.copy().feed(b'3') and g.copy().feed(b'4') and g.copy().feed(b', 3]')
