"""JSON Schema values and negation: what rewrite.py needs to say "not this" in forms llguidance enforces.

`negate(n, ctx)` returns a schema that, together with `ctx` (the schema `n` sits in), admits exactly the values
`ctx` admits and `n` refuses, or None where no such form is known here (see rewrite.py for where it is used).
"""
from __future__ import annotations

import math
from typing import Any

NOTES = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
MAX_INTERVALS = 64     # `not: {type: integer}` on a bounded number: at most this many open intervals
MAX_WORDS_CHARS = 512  # `not: {enum: [strings]}` as a complement pattern: at most this many characters in all


# ---------------------------------------------------------------------------------------------- helpers
def same(a: Any, b: Any) -> bool:
    """JSON equality as JSON Schema defines it (1 == 1.0, true != 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def bare(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in NOTES}


def types_of(s: dict) -> list[str] | None:
    t = s.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return list(t)
    return None


def intersect_types(a: list[str], b: list[str]) -> list[str]:
    out = []
    for t in a:
        if t in b or (t == "integer" and "number" in b):
            out.append(t)
        elif t == "number" and "integer" in b:
            out.append("integer")
    return list(dict.fromkeys(out))


def values_of(s: dict) -> list | None:
    """The finite set of values `s` restricts to (enum / const / boolean / null), or None."""
    if "const" in s:
        return [s["const"]]
    if isinstance(s.get("enum"), list):
        return s["enum"]
    if types_of(s) == ["boolean"]:
        return [True, False]
    if types_of(s) == ["null"]:
        return [None]
    return None


def lit(c: str) -> str:
    return "\\" + c if c in "\\^$.|?*+()[]{}" else c


def _cls(chars) -> str:
    return "".join("\\" + c if c in "\\]^-[" else c for c in sorted(chars))


def other_strings(words: list[str]) -> str:
    """An anchored regex (no look-around) matching every string except those in `words`."""
    trie: dict = {}
    for w in words:
        node = trie
        for c in w:
            node = node.setdefault(c, {})
        node[""] = {}

    def rx(node: dict) -> str:
        kids = sorted(k for k in node if k)
        alts = [] if "" in node else [""]       # end here (unless a refused word ends here)
        alts.append(f"[^{_cls(kids)}][\\s\\S]*" if kids else "[\\s\\S]+")
        alts += [lit(c) + rx(node[c]) for c in kids]
        return "(?:" + "|".join(alts) + ")"
    return "^" + rx(trie) + "$"


def absent(name: str) -> dict:
    return {"properties": {name: False}}


# ---------------------------------------------------------------------------------------------- negation
def negate(n: Any, ctx: dict) -> dict | None:
    """A schema llguidance can enforce that, together with `ctx` (the schema `n` sits in), admits exactly the
    values `ctx` admits and `n` refuses; None when no such form is known here."""
    if not isinstance(n, dict):
        return None
    n = bare(n)
    if len(n) != 1:
        if set(n) == {"type", "const"} or set(n) == {"type", "enum"}:  # {type: string, const: x}: enum decides
            n = {k: v for k, v in n.items() if k != "type"} if _vals_match_type(n) else n
        if len(n) != 1:
            return None
    (key, val), = n.items()
    if key == "type":
        refused = [val] if isinstance(val, str) else val
        if not isinstance(refused, list) or not all(t in TYPES for t in refused):
            return None
        if "number" in refused:
            refused = [*refused, "integer"]
        if "integer" in refused and "number" not in refused:
            return _non_integers(ctx)
        left = [t for t in TYPES if t not in refused and t != "integer"]
        return {"type": left} if left else None
    if key in ("const", "enum"):
        refused = [val] if key == "const" else val
        if not isinstance(refused, list):
            return None
        own = values_of(ctx)
        if own is not None:
            kept = [v for v in own if not any(same(v, r) for r in refused)]
            return {"enum": kept} if kept else None
        if types_of(ctx) == ["string"] and all(isinstance(r, str) for r in refused):
            if refused == [""]:
                return {"minLength": 1}
            if "pattern" not in ctx and sum(map(len, refused)) <= MAX_WORDS_CHARS:
                return {"pattern": other_strings(refused)}
        return None
    if key == "required" and isinstance(val, list) and val and all(isinstance(p, str) for p in val):
        have = set(x for x in ctx.get("required", []) if isinstance(x, str)) \
            if isinstance(ctx.get("required"), list) else set()
        branches = [absent(p) for p in val if p not in have]
        if not branches:
            return None
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    if key == "properties" and isinstance(val, dict) and val:
        props = ctx.get("properties") if isinstance(ctx.get("properties"), dict) else {}
        branches = []
        for p, sub in val.items():
            inner = props.get(p, {})
            neg = negate(sub, inner if isinstance(inner, dict) else {})
            if neg is None:
                return None
            branches.append({"required": [p], "properties": {p: neg}})
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    return None


def _vals_match_type(n: dict) -> bool:
    vals = [n["const"]] if "const" in n else n["enum"]
    t = n["type"]
    return t == "string" and isinstance(vals, list) and all(isinstance(v, str) for v in vals)


def _non_integers(ctx: dict) -> dict | None:
    """`not: {type: integer}` inside a bounded number schema: the open intervals between its integers."""
    if types_of(ctx) != ["number"]:
        return None
    lo = [ctx[k] for k in ("minimum", "exclusiveMinimum") if isinstance(ctx.get(k), (int, float))
          and not isinstance(ctx.get(k), bool)]
    hi = [ctx[k] for k in ("maximum", "exclusiveMaximum") if isinstance(ctx.get(k), (int, float))
          and not isinstance(ctx.get(k), bool)]
    if not lo or not hi or not all(map(math.isfinite, lo + hi)):
        return None
    a, b = math.floor(max(lo)), math.ceil(min(hi))
    if b <= a or b - a > MAX_INTERVALS:
        return None
    spans = [{"exclusiveMinimum": k, "exclusiveMaximum": k + 1} for k in range(a, b)]
    return spans[0] if len(spans) == 1 else {"anyOf": spans}
