"""A request's JSON Schema turned into what llguidance enforces, plus what is checked after the draft.

`prepare(schema, strict, compile)` returns a `Prepared`: the schema llguidance enforces while decoding
(`enforced`) and, where some keyword had to be relaxed for that, the schema the finished answer is
validated against with `jsonschema` (`check`; None when the grammar alone guarantees validity).

Steps, each driven by what llguidance reports (llguidance 1.9.1):

  strict        under `strict: true` every object schema that declares `properties` and does not set
                `additionalProperties` gets `additionalProperties: false` (OpenAI's strict mode: only the
                declared properties). Without strict, JSON Schema's default holds (other keys allowed).
  dependencies  the draft-07 keyword is split into its 2019-09 successors `dependentRequired` and
                `dependentSchemas`, so that the check below validates it under any draft.
  formats       an unknown `format` value is an annotation (JSON Schema 2020-12, section 7.2): it is
                dropped, not rejected. Formats llguidance knows (`date-time`, `email`, `uuid`, ...) stay
                enforced.
  rewrites      rewrite.py turns `not`, `if`/`then`/`else`, `dependentRequired`/`dependentSchemas`,
                `propertyNames`, min/maxProperties llguidance refuses, `$ref` with siblings and trivial
                `uniqueItems` into exact forms llguidance enforces; `uniqueItems` arrays of scalars are kept
                distinct by the JSON guard (guard.py). Whatever was rewritten is still checked after the draft.
  oneOf         llguidance enforces a `oneOf` whose branches it can tell apart (types, consts, enums);
                rewrite.py makes others disjoint where it can negate the branches (`required`, ...);
                any other `oneOf` is generated as `anyOf` (llguidance's `coerce_one_of`) and checked
                after the draft ("exactly one branch").
  $ref siblings a circular `$ref` with sibling keywords rewrite.py could not merge becomes
                `allOf: [{"$ref": ...}, {siblings}]`.
  min/maxProperties  where llguidance still refuses them (more than rewrite.MAX_OPTIONAL optional properties):
                removed and checked after the draft.
  the rest      keywords llguidance does not implement and rewrite.py found no exact form for (`not`,
                `if`/`then`/`else`, `uniqueItems`, `propertyNames`, `dependentRequired`, `dependentSchemas`,
                `contains`, ...) are removed from the enforced schema and checked after the draft.

Anything else llguidance refuses (a look-around pattern, a broken `$ref`, an invalid schema) stays a
400 naming it. A schema with a `check` must itself be a valid JSON Schema for `jsonschema`.
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unmask.errors import InvalidRequestError
from unmask.structured.rewrite import rewrite, rewrite_one_ofs, unique_paths

# keywords whose value is one schema / a list of schemas / a name -> schema map
ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
       "unevaluatedProperties", "unevaluatedItems", "additionalItems")
MANY = ("anyOf", "allOf", "oneOf", "prefixItems")
MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords llguidance may report as unimplemented that jsonschema validates: relaxed and checked after the draft
CHECKABLE = {"not", "if", "then", "else", "uniqueItems", "propertyNames", "dependentRequired",
             "dependentSchemas", "contains", "minContains", "maxContains", "unevaluatedProperties",
             "unevaluatedItems", "dependencies", "additionalItems"}
MAX_ROUNDS = 12


@dataclass(frozen=True)
class Prepared:
    enforced: Any            # the schema llguidance compiles (with unmask's x-guidance options)
    check: Any | None        # validated with jsonschema after the draft; None: the grammar guarantees it
    coerce_one_of: bool = False
    relaxed: tuple[str, ...] = ()   # what is checked after the draft instead of enforced (for messages, stats)
    rewritten: tuple[str, ...] = ()  # what rewrite.py turned into an enforced form (also checked after the draft)
    unique: tuple = ()   # (path, item set or None): uniqueItems arrays of scalars the JSON guard keeps distinct


def walk(node: Any, fn: Callable[[dict, str | None], None], parent: str | None = None) -> None:
    """Calls fn(schema, keyword it sits under) on every subschema dict, depth first (children first)."""
    if not isinstance(node, dict):
        return
    for k in ONE:
        if isinstance(node.get(k), dict):
            walk(node[k], fn, k)
    if isinstance(node.get("items"), list):  # draft-07 tuple items
        for s in node["items"]:
            walk(s, fn, "items")
    for k in MANY:
        if isinstance(node.get(k), list):
            for s in node[k]:
                walk(s, fn, k)
    for k in MAP:
        if isinstance(node.get(k), dict):
            for s in node[k].values():
                walk(s, fn, k)
    if isinstance(node.get("dependencies"), dict):
        for s in node["dependencies"].values():
            walk(s, fn, "dependencies")
    fn(node, parent)


def strict_objects(schema: Any) -> None:
    """OpenAI strict mode: objects that declare properties allow only those (additionalProperties: false)."""
    def fix(s: dict, parent: str | None) -> None:
        # allOf members describe parts of one object: closing each would forbid the others' properties
        if parent != "allOf" and "properties" in s and "additionalProperties" not in s and "allOf" not in s \
                and "$ref" not in s and "unevaluatedProperties" not in s:
            s["additionalProperties"] = False
    walk(schema, fix)


def split_dependencies(schema: Any) -> None:
    def fix(s: dict, parent: str | None) -> None:
        deps = s.get("dependencies")
        if not isinstance(deps, dict):
            return
        del s["dependencies"]
        for name, dep in deps.items():
            key = "dependentRequired" if isinstance(dep, list) else "dependentSchemas"
            s.setdefault(key, {})[name] = dep
    walk(schema, fix)


def drop_format(schema: Any, fmt: str) -> None:
    def fix(s: dict, parent: str | None) -> None:
        if s.get("format") == fmt:
            del s["format"]
    walk(schema, fix)


def drop_keys(schema: Any, keys: set[str]) -> None:
    def fix(s: dict, parent: str | None) -> None:
        for k in keys & s.keys():
            del s[k]
    walk(schema, fix)


def wrap_ref_siblings(schema: Any) -> bool:
    """`{"$ref": r, ...}` -> `{"allOf": [{"$ref": r}, {...}]}` (annotations stay put); True if anything changed."""
    notes = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
    changed = False

    def fix(s: dict, parent: str | None) -> None:
        nonlocal changed
        if "$ref" not in s:
            return
        rest = {k: v for k, v in s.items() if k not in notes and k not in ("$ref", "$defs", "definitions", "$schema",
                                                                            "$id", "x-guidance")}
        if not rest:
            return
        ref = s.pop("$ref")
        for k in rest:
            del s[k]
        s["allOf"] = [{"$ref": ref}, rest]
        changed = True
    walk(schema, fix)
    return changed


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_FORMAT = re.compile(r"Unknown format: (\S+)")


def prepare(schema: Any, strict: bool, compile_error: Callable[[Any, bool], str | None],
            relax: bool = True) -> Prepared:
    """`compile_error(enforced, coerce_one_of)` -> llguidance's error message, or None if it compiles.
    `relax=False` (tool parameters, embedded in a call grammar as they are): llguidance's verdict unchanged.

    Raises InvalidRequestError (naming llguidance's complaint) for what cannot be handled."""
    if isinstance(schema, bool):
        return Prepared(schema, None)
    if not relax:
        err = compile_error(schema, False)
        if err is not None:
            raise InvalidRequestError(err)
        return Prepared(schema, None)
    nothing = []
    walk(schema, lambda s, parent: nothing.append(1) if s.get("not") in ({}, True) else None)
    if nothing:
        raise InvalidRequestError("`not: {}` accepts no value at all")
    check = copy.deepcopy(schema)
    if strict:
        strict_objects(check)
    split_dependencies(check)
    enforced = copy.deepcopy(check)
    try:
        trial = copy.deepcopy(enforced)
        unique = tuple(unique_paths(trial).items())
        rewritten = tuple(rewrite(trial))
        enforced = trial
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError):
        unique, rewritten = (), ()   # a malformed corner rewrite.py did not foresee: relax and check as before
    coerce, relaxed, wrapped = False, [], False
    for _ in range(MAX_ROUNDS):
        err = compile_error(enforced, coerce)
        if err is None:
            break
        if m := _FORMAT.search(err):
            fmt = m.group(1).strip("\"'`,.")
            drop_format(enforced, fmt)
            drop_format(check, fmt)    # an annotation: not validated after the draft either
            continue
        if m := _UNIMPLEMENTED.search(err):
            keys = set(json.loads(f"[{m.group(1)}]"))
            if not keys <= CHECKABLE:
                raise InvalidRequestError(err)
            drop_keys(enforced, keys)
            relaxed += sorted(keys)
            continue
        if "min/maxProperties" in err and "minProperties/maxProperties" not in relaxed:
            drop_keys(enforced, {"minProperties", "maxProperties"})   # where rewrite.py found no enforced form
            relaxed.append("minProperties/maxProperties")
            continue
        if "oneOf" in err and "oneOf" not in rewritten and rewrite_one_ofs(enforced):
            rewritten += ("oneOf",)
            continue
        if "oneOf" in err and not coerce:
            coerce = True
            relaxed.append("oneOf")
            continue
        if "sibling keys" in err and not wrapped:
            wrapped = wrap_ref_siblings(enforced)
            if wrapped:
                continue
        raise InvalidRequestError(err)
    else:
        raise InvalidRequestError(err)
    if not relaxed and not rewritten:
        return Prepared(enforced, None, coerce)
    try:
        import jsonschema

        jsonschema.validators.validator_for(check, default=jsonschema.Draft202012Validator).check_schema(check)
    except jsonschema.SchemaError as e:
        raise InvalidRequestError(f"invalid JSON Schema ({', '.join([*relaxed, *rewritten])} must be checked "
                                  f"after the draft): {e.message}") from None
    return Prepared(enforced, check, coerce, tuple(relaxed), rewritten,
                    unique if "uniqueItems" in relaxed else ())


def check_error(check: Any, value: Any) -> str | None:
    """Why `value` fails the after-draft check, or None."""
    import jsonschema

    cls = jsonschema.validators.validator_for(check, default=jsonschema.Draft202012Validator)
    try:
        err = jsonschema.exceptions.best_match(cls(check).iter_errors(value))
    except Exception as e:  # noqa: BLE001 - an unresolvable $ref and the like: the answer cannot be vouched for
        return f"cannot be checked: {e}"
    return None if err is None else err.message


def duplicate_key_hook(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


def parse_json(text: str) -> tuple[Any, str | None]:
    """(value, None) or (None, why it is not acceptable JSON: a syntax error or a repeated key)."""
    try:
        return json.loads(text, object_pairs_hook=duplicate_key_hook), None
    except ValueError as e:
        return None, str(e)
