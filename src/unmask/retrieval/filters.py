"""OpenAI's attribute filters and file attributes, checked and evaluated.

A comparison filter is `{"type": "eq"|"ne"|"gt"|"gte"|"lt"|"lte", "key", "value"}` with a string, number or
boolean value; a compound filter is `{"type": "and"|"or", "filters": [...]}`, nested freely. A file without the
key matches no comparison (as NULL in SQL), and an ordering between a string and a number is false rather than
an error. Filters are evaluated over the files' attributes here, once per search, and the backends search only
the files that pass: the same semantics on SQLite and Postgres.

Attributes: at most 16 keys of at most 64 characters; values are strings (at most 512 characters), numbers or
booleans (OpenAI's limits).
"""
from __future__ import annotations

import operator
from typing import Any

COMPARISONS = {"eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "gte": operator.ge, "lt": operator.lt,
               "lte": operator.le}
COMPOUNDS = ("and", "or")
MAX_ATTRIBUTES, MAX_KEY, MAX_STRING = 16, 64, 512


class FilterError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, bool, int, float))


def check_filter(f: Any, param: str = "filters") -> None:
    if not isinstance(f, dict):
        raise FilterError(f"{param} must be an object", param)
    kind = f.get("type")
    if kind in COMPARISONS:
        if not isinstance(f.get("key"), str):
            raise FilterError(f"{param}.key must be a string", f"{param}.key")
        if not _scalar(f.get("value")):
            raise FilterError(f"{param}.value must be a string, number or boolean", f"{param}.value")
    elif kind in COMPOUNDS:
        subs = f.get("filters")
        if not isinstance(subs, list) or not subs:
            raise FilterError(f"{param}.filters must be a non-empty list", f"{param}.filters")
        for i, sub in enumerate(subs):
            check_filter(sub, f"{param}.filters[{i}]")
    else:
        raise FilterError(f"{param}.type must be one of {', '.join([*COMPARISONS, *COMPOUNDS])}, got {kind!r}",
                          f"{param}.type")


def matches(f: dict, attributes: dict[str, Any]) -> bool:
    kind = f["type"]
    if kind == "and":
        return all(matches(sub, attributes) for sub in f["filters"])
    if kind == "or":
        return any(matches(sub, attributes) for sub in f["filters"])
    if f["key"] not in attributes:
        return False
    have, want = attributes[f["key"]], f["value"]
    if isinstance(have, str) != isinstance(want, str) or isinstance(have, bool) != isinstance(want, bool):
        return kind == "ne"   # different kinds are never equal, and never ordered
    return COMPARISONS[kind](have, want)


def check_attributes(attributes: Any, param: str = "attributes") -> dict[str, Any]:
    if attributes is None:
        return {}
    if not isinstance(attributes, dict):
        raise FilterError(f"{param} must be an object", param)
    if len(attributes) > MAX_ATTRIBUTES:
        raise FilterError(f"{param} has {len(attributes)} keys; at most {MAX_ATTRIBUTES}", param)
    for key, value in attributes.items():
        if len(key) > MAX_KEY:
            raise FilterError(f"{param} key {key[:20]!r}... is longer than {MAX_KEY} characters", param)
        if not _scalar(value):
            raise FilterError(f"{param}.{key} must be a string, number or boolean", f"{param}.{key}")
        if isinstance(value, str) and len(value) > MAX_STRING:
            raise FilterError(f"{param}.{key} is longer than {MAX_STRING} characters", f"{param}.{key}")
    return attributes
