"""Exact rewrites of JSON Schema keywords llguidance does not implement into forms it enforces.

`rewrite(schema)` edits the schema llguidance will compile, in place, and returns the names of the keywords
it rewrote. Each rewrite admits exactly the values the original admits, or fewer (never more); where no
such form is known here the keyword is left for schema.py to relax and check after the draft. The
original schema is still checked after the draft whenever anything was rewritten (the safety net).

  not           `not` is negated into a positive schema (negate.py): a type list's complement, an enum or
                const removed from the enum it restricts (or, for strings, a pattern matching every other
                string), `required` as "one of them absent", one property's negation as "present and
                negated", `not: {type: integer}` on a bounded number as the open intervals between integers.
  if/then/else  `anyOf: [allOf: [if, then], allOf: [not-if, else]]`, where `not-if` is `negate(if)`.
  dependentRequired / dependentSchemas
                per name: `anyOf: [{name absent}, {required: [name, ...], ...}]`.
  propertyNames a pattern, length bounds or enum as the only key of `patternProperties` (carrying what
                `additionalProperties` said), with `additionalProperties: false`; declared properties whose
                name it refuses become `false`.
  min/maxProperties
                redundant bounds are dropped (a closed object with no more properties than the maximum, a
                minimum the required ones meet); llguidance's own rule (all listed properties required) is
                met by an `anyOf` over which optional properties are present, for up to MAX_OPTIONAL of them.
  uniqueItems   trivial at maxItems <= 1; over a finite item set (enum, const, boolean) maxItems is capped at
                its size; arrays of scalars reached through `properties` / `items` from the root are made
                distinct by the JSON guard (guard.py, `unique_paths`).
  oneOf         where llguidance cannot tell the branches apart: `anyOf` of each branch AND the negation of
                every other (so exactly one holds), where those negations are known.
  $ref siblings a `$ref` to a local definition with sibling keywords becomes a `$ref` to a new definition: a
                copy of the target with the siblings merged in (llguidance refuses siblings next to a
                circular reference).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from unmask.structured.negate import (NOTES, absent, bare, intersect_types, lit, negate, same, types_of,
                                      values_of)

MAX_OPTIONAL = 4       # maxProperties: anyOf over at most 2**MAX_OPTIONAL presence patterns
MAX_RANGE = 256        # uniqueItems over integers: the guard knows the item set of a range this small
MAX_ONE_OF = 4         # oneOf made disjoint: at most this many branches (each gets the others' negations)
SCALARS = {"null", "boolean", "number", "string", "integer"}
TOGETHER = ({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"},
            {"prefixItems", "items", "additionalItems", "unevaluatedItems", "contains", "minContains", "maxContains"},
            {"if", "then", "else"})


def add_conjunct(s: dict, extra: dict) -> None:
    """s := s AND extra (merged where that is plain, else appended to s's allOf)."""
    extra = dict(extra)
    if "type" in extra and types_of(s) is not None and types_of(extra) is not None:
        s["type"] = intersect_types(types_of(s), types_of(extra))
        del extra["type"]
    if "required" in extra and isinstance(s.get("required", []), list) \
            and all(isinstance(x, str) for x in s.get("required", [])):
        s["required"] = list(dict.fromkeys([*s.get("required", []), *extra.pop("required")]))
    if "minLength" in extra and isinstance(s.get("minLength", 0), int):
        s["minLength"] = max(s.get("minLength", 0), extra.pop("minLength"))
    for k in list(extra):
        if k not in s and k not in ("anyOf", "allOf", "oneOf", "properties", "$ref"):
            s[k] = extra.pop(k)
    if extra:
        s.setdefault("allOf", []).append(extra)


# ---------------------------------------------------------------------------------------------- per keyword
def rewrite_not(s: dict) -> bool:
    neg = negate(s.get("not"), s)
    if neg is None:
        return False
    del s["not"]
    add_conjunct(s, neg)
    return True


def rewrite_if(s: dict) -> bool:
    cond, then, other = s.get("if"), s.get("then", True), s.get("else", True)
    if cond is None:
        return False
    if then is True and other is True or cond is True and then is True:
        for k in ("if", "then", "else"):
            s.pop(k, None)
        return True
    neg = negate(cond, s) if isinstance(cond, dict) else None
    if neg is None or not isinstance(then, dict | bool) or not isinstance(other, dict | bool):
        return False
    yes = [x for x in (cond, then) if x is not True]
    no = [x for x in (neg, other) if x is not True]
    for k in ("if", "then", "else"):
        s.pop(k, None)
    s.setdefault("allOf", []).append({"anyOf": [{"allOf": yes}, {"allOf": no}]})
    return True


def rewrite_dependents(s: dict) -> list[str]:
    done = []
    req = s.get("dependentRequired")
    if isinstance(req, dict) and all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in req.values()):
        for name, needs in req.items():
            add_conjunct(s, {"anyOf": [absent(name), {"required": list(dict.fromkeys([name, *needs]))}]})
        del s["dependentRequired"]
        done.append("dependentRequired")
    dep = s.get("dependentSchemas")
    if isinstance(dep, dict) and all(isinstance(v, dict | bool) for v in dep.values()):
        for name, sub in dep.items():
            present = {"required": [name]} if sub is True else {"allOf": [{"required": [name]}, sub]}
            add_conjunct(s, {"anyOf": [absent(name), present]})
        del s["dependentSchemas"]
        done.append("dependentSchemas")
    return done


def key_pattern(pn: Any) -> str | None:
    """propertyNames as one regex over the key, or None."""
    if not isinstance(pn, dict):
        return None
    pn = {k: v for k, v in bare(pn).items() if not (k == "type" and v == "string")}
    if set(pn) == {"pattern"} and isinstance(pn["pattern"], str):
        return pn["pattern"]
    if pn and set(pn) <= {"minLength", "maxLength"} and all(isinstance(v, int) and v >= 0 for v in pn.values()):
        return f"^[\\s\\S]{{{pn.get('minLength', 0)},{pn.get('maxLength', '')}}}$"
    vals = [pn["const"]] if set(pn) == {"const"} else pn.get("enum") if set(pn) == {"enum"} else None
    if isinstance(vals, list) and vals and all(isinstance(v, str) for v in vals):
        return "^(?:" + "|".join("".join(lit(c) for c in v) for v in vals) + ")$"
    return None


def rewrite_property_names(s: dict) -> bool:
    pat = key_pattern(s.get("propertyNames"))
    extra = s.get("additionalProperties", True)
    props = s.get("properties", {})
    if pat is None or "patternProperties" in s or not isinstance(props, dict):
        return False
    if props and extra not in (True, {}, False):
        return False    # patternProperties would also apply to the declared properties
    try:
        rx = re.compile(pat)
    except re.error:
        return False
    for name in props:
        if not rx.search(name):
            props[name] = False
    del s["propertyNames"]
    if extra is not False:
        s["patternProperties"] = {pat: {} if extra is True else extra}
        s["additionalProperties"] = False
    return True


def rewrite_property_bounds(s: dict) -> bool:
    """Drops redundant min/maxProperties; else an anyOf over the optional properties' presence."""
    props = s.get("properties", {})
    if not isinstance(props, dict) or not ({"minProperties", "maxProperties"} & s.keys()):
        return False
    req = s.get("required", [])
    if not isinstance(req, list) or not all(isinstance(x, str) for x in req):
        return False
    closed = s.get("additionalProperties") is False and not s.get("patternProperties")
    changed = False
    if closed and isinstance(s.get("maxProperties"), int) and len(props) <= s["maxProperties"]:
        del s["maxProperties"]
        changed = True
    if isinstance(s.get("minProperties"), int) and len(set(req)) >= s["minProperties"]:
        del s["minProperties"]
        changed = True
    optional = [p for p in props if p not in req and props[p] is not False]
    if not ({"minProperties", "maxProperties"} & s.keys()) or not optional or len(optional) > MAX_OPTIONAL:
        return changed
    branches = []
    for mask in range(1 << len(optional)):
        on = [p for i, p in enumerate(optional) if mask >> i & 1]
        off = [p for p in optional if p not in on]
        b: dict = {}
        if on:
            b["required"] = on
        if off:
            b["properties"] = {p: False for p in off}
        branches.append(b)
    s.setdefault("allOf", []).append({"anyOf": branches})
    return True


def rewrite_unique(s: dict) -> str | None:
    """'trivial' / 'capped' / None. Distinctness itself is left to the guard or the after-draft check."""
    if s.get("uniqueItems") is not True:
        return None
    if isinstance(s.get("maxItems"), int) and s["maxItems"] <= 1:
        del s["uniqueItems"]
        return "trivial"
    items = s.get("items")
    vals = values_of(items) if isinstance(items, dict) and "prefixItems" not in s else None
    if vals is not None:
        n = len([v for i, v in enumerate(vals) if not any(same(v, w) for w in vals[:i])])
        s["maxItems"] = min(s.get("maxItems", n), n) if isinstance(s.get("maxItems", n), int) else n
        return "capped"
    return None


def int_range(s: dict) -> list[int] | None:
    """The integers a bounded integer schema allows (a superset where `multipleOf` thins them), if few."""
    if types_of(s) != ["integer"]:
        return None
    num = {k: v for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
           if isinstance(v := s.get(k), int | float) and not isinstance(v, bool) and math.isfinite(v)}
    lo = [math.ceil(num["minimum"])] if "minimum" in num else []
    lo += [math.floor(num["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in num else []
    hi = [math.floor(num["maximum"])] if "maximum" in num else []
    hi += [math.ceil(num["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in num else []
    if not lo or not hi or not 0 <= min(hi) - max(lo) < MAX_RANGE:
        return None
    return list(range(max(lo), min(hi) + 1))


def scalar_items(s: dict) -> bool:
    items = s.get("items")
    if not isinstance(items, dict) or "prefixItems" in s:
        return False
    vals = values_of(items)
    if vals is not None:
        return all(not isinstance(v, dict | list) for v in vals)
    t = types_of(items)
    return t is not None and set(t) <= SCALARS


def unique_paths(schema: Any) -> dict[tuple[str, ...], tuple | None]:
    """Paths (property names, "*" for an array item) from the root, through `properties` and `items` only, of
    the `uniqueItems` arrays of scalars -> their finite item set, or None; the guard keeps their items distinct."""
    out: dict[tuple[str, ...], tuple | None] = {}

    def visit(s: Any, path: tuple[str, ...]) -> None:
        if not isinstance(s, dict):
            return
        if s.get("uniqueItems") is True and scalar_items(s):
            vals = values_of(s["items"])
            vals = int_range(s["items"]) if vals is None else vals
            out[path] = None if vals is None else tuple(vals)
        if isinstance(s.get("properties"), dict):
            for name, sub in s["properties"].items():
                visit(sub, (*path, name))
        if isinstance(s.get("items"), dict) and "prefixItems" not in s:
            visit(s["items"], (*path, "*"))
    visit(schema, ())
    return out


def rewrite_one_of(s: dict) -> bool:
    """`oneOf: [b1, ..., bn]` -> `anyOf: [b1 AND NOT b2 ..., ...]` (disjoint, so "exactly one" holds), where every
    branch's negation is known (`negate`) and n <= MAX_ONE_OF."""
    branches = s.get("oneOf")
    if not isinstance(branches, list) or not 2 <= len(branches) <= MAX_ONE_OF \
            or not all(isinstance(b, dict) for b in branches):
        return False
    base = {k: v for k, v in s.items() if k != "oneOf"}
    out = []
    for i, b in enumerate(branches):
        ctx = merge(base, b) or base
        negs = [negate(c, ctx) for j, c in enumerate(branches) if j != i]
        if any(n is None for n in negs):
            return False
        out.append({"allOf": [b, *negs]})
    del s["oneOf"]
    if "anyOf" in s:
        s.setdefault("allOf", []).append({"anyOf": out})
    else:
        s["anyOf"] = out
    return True


def rewrite_one_ofs(schema: Any) -> bool:
    """rewrite_one_of everywhere (called only where llguidance refused a oneOf it cannot tell apart)."""
    from unmask.structured.schema import walk

    done = []

    def fix(s: dict, parent: str | None) -> None:
        try:   # rewrite_one_of changes nothing before it has the whole result
            if "oneOf" in s and rewrite_one_of(s):
                done.append(1)
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError):
            pass   # a malformed branch: left to coerce_one_of and the after-draft check
    walk(schema, fix)
    return bool(done)


# ---------------------------------------------------------------------------------------------- $ref siblings
def inline_ref_siblings(schema: Any, rounds: int = 8) -> bool:
    """`{"$ref": "#/$defs/x", k: v}` -> `{"$ref": "#/$defs/x__n"}` with x__n = x merged with {k: v} (repeated, as
    the copies hold such references too; the same reference with the same siblings shares one copy)."""
    made: dict[str, str] = {}
    changed = False
    for _ in range(rounds):
        if not _inline_once(schema, made):
            break
        changed = True
    return changed


def _inline_once(schema: Any, made: dict[str, str]) -> bool:
    if not isinstance(schema, dict):
        return False
    changed = False
    pending: list[tuple[dict, str, dict]] = []   # new definitions, added after the walk

    def target(ref: str) -> tuple[dict, str] | None:
        m = re.fullmatch(r"#/(\$defs|definitions)/([^/~]+)", ref)
        if not m or not isinstance(schema.get(m.group(1)), dict):
            return None
        t = schema[m.group(1)].get(m.group(2))
        return (schema[m.group(1)], m.group(2)) if isinstance(t, dict) and "$ref" not in t else None

    def fix(s: dict, parent: str | None) -> None:
        nonlocal changed
        if not isinstance(s.get("$ref"), str):
            return
        rest = {k: v for k, v in s.items() if k not in NOTES and k != "$ref"}
        if not rest or {"$defs", "definitions", "$schema", "$id"} & rest.keys():
            return
        found = target(s["$ref"])
        if found is None:
            return
        defs, name = found
        merged = merge(defs[name], rest)
        if merged is None:
            return
        rewrite_property_bounds(merged)
        key = json.dumps([s["$ref"], rest], sort_keys=True)
        if key not in made:
            n = 1
            while f"{name}__{n}" in defs or any(d is defs and k == f"{name}__{n}" for d, k, _ in pending):
                n += 1
            pending.append((defs, f"{name}__{n}", merged))
            made[key] = f"{s['$ref'].rsplit('/', 1)[0]}/{name}__{n}"
        for k in rest:
            del s[k]
        s["$ref"] = made[key]
        changed = True
    from unmask.structured.schema import walk
    walk(schema, fix)
    for defs, key, merged in pending:
        defs[key] = merged
    return changed


def merge(a: dict, b: dict) -> dict | None:
    """a AND b as one schema, or None where that is not plain."""
    for group in TOGETHER:   # keywords that read each other (additionalProperties looks at properties, ...)
        ka, kb = group & a.keys(), group & b.keys()
        if ka and kb and not (ka == kb and all(same(a[k], b[k]) for k in ka)):
            return None
    out = json.loads(json.dumps(a))
    for k, v in b.items():
        if k not in out or same(out[k], v):
            out[k] = v
        elif k == "required" and isinstance(v, list) and isinstance(out[k], list):
            out[k] = list(dict.fromkeys([*out[k], *v]))
        elif k.startswith("max") and isinstance(v, int) and isinstance(out[k], int):
            out[k] = min(out[k], v)
        elif k.startswith("min") and isinstance(v, int) and isinstance(out[k], int):
            out[k] = max(out[k], v)
        elif k == "type" and types_of(out) is not None and types_of(b) is not None:
            out[k] = intersect_types(types_of(out), types_of(b))
        else:
            return None
    return out


# ---------------------------------------------------------------------------------------------- all of it
def rewrite(schema: Any) -> list[str]:
    """Rewrites `schema` in place (see the module docstring); the keywords it rewrote."""
    from unmask.structured.schema import walk

    done: list[str] = []

    def fix(s: dict, parent: str | None) -> None:
        if "not" in s and rewrite_not(s):
            done.append("not")
        if "if" in s and rewrite_if(s):
            done.append("if")
        done.extend(rewrite_dependents(s))
        if "propertyNames" in s and rewrite_property_names(s):
            done.append("propertyNames")
        if rewrite_property_bounds(s):
            done.append("maxProperties")
        if rewrite_unique(s) == "trivial":
            done.append("uniqueItems")
    walk(schema, fix)
    if inline_ref_siblings(schema):
        done.append("$ref")
    return list(dict.fromkeys(done))
