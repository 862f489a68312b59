"""What a JSON grammar cannot say and a JSON answer must still respect, checked while decoding.

llguidance's JSON grammar is context-free: it cannot forbid an object key that was already written
(`{"B": 1, "B": 2}` is grammatical wherever other keys are allowed), nor does it bound numbers or strings
the schema leaves unbounded. `JsonGuard` reads the committed JSON text byte by byte (a small lexer: the
container stack, the keys of each open object, the string or number being written) and bans the tokens
that would:

  - close an object key equal to one already in that object (the key must then go on, or differ);
  - write more than MAX_INT_DIGITS digits before a number's point, MAX_FRAC_DIGITS after it, or
    MAX_EXP_DIGITS in its exponent;
  - write more than MAX_KEY_CHARS characters in a key, or MAX_STRING_CHARS in a string value;
  - complete an item equal to an earlier item of the same array, in the arrays at `unique` paths (property
    names, "*" for an array's item, from the root: rewrite.unique_paths, the `uniqueItems` arrays of scalars);
    where the items come from a known finite set (an enum), already start an item that can only end up
    repeating one (the grammar would force the rest of it, unscreened).

The bans are soft: where they would leave no grammatical token at all (a schema that demands a
longer string, say), the grammar's own mask is used unchanged. Forced text is not screened (the grammar
leaves it no choice); the budget closer (constraint.closing_path) is: it skips a closing text the guard
refuses (a key string closed into one the object has) and picks its own tokens among those the guard allows.
"""
from __future__ import annotations

import json

import torch
from torch import Tensor

MAX_INT_DIGITS = 20    # a signed 64-bit integer has 19; more is runaway
MAX_FRAC_DIGITS = 17   # what a float64 can hold
MAX_EXP_DIGITS = 3
MAX_KEY_CHARS = 256
MAX_STRING_CHARS = 4096
QUOTE = ord('"')
ENDS = b',]} \n\r\t'   # bytes that end a number or a literal


class Frame:
    """One open container: `seen` holds an object's keys, or a unique array's items; `key` the object's last key."""
    __slots__ = ("kind", "seen", "key", "unique", "values")

    def __init__(self, kind: str, unique: bool = False, values: tuple | None = None):
        self.kind, self.seen, self.key, self.unique = kind, set(), None, unique
        self.values = values    # a unique array's possible items as (tag, value) (see `_tagged`), or None

    def copy(self) -> Frame:
        f = Frame(self.kind, self.unique, self.values)
        f.seen, f.key = set(self.seen), self.key
        return f


class TokenFacts:
    """Per-token facts the guard's masks need, built once per tokenizer."""

    def __init__(self, token_bytes: list[bytes]):
        self.bytes = token_bytes
        self.has_quote = torch.tensor([QUOTE in b for b in token_bytes], dtype=torch.bool)
        self.lead_digits = torch.tensor([len(b) - len(b.lstrip(b"0123456789")) for b in token_bytes])
        self.quote_ids = self.has_quote.nonzero().flatten()
        self.ends_ids = torch.tensor([any(c in ENDS for c in b) or QUOTE in b for b in token_bytes],
                                     dtype=torch.bool).nonzero().flatten()


class JsonGuard:
    """Lexer state after the committed text. `mode`: value (a value may start), key (a key or `}`), colon,
    after (`,` or a close), string, number, literal."""

    def __init__(self, unique=()):
        # paths of arrays whose scalar items must differ -> their finite item set (JSON values) or None
        self.unique = unique if isinstance(unique, dict) else {p: None for p in unique}
        self.stack: list[Frame] = []
        self.mode = "value"
        self.is_key = False
        self.raw = bytearray()     # the string's bytes so far (escapes as written)
        self.esc = False
        self.chars = 0
        self.seg = "int"           # number segment: int | frac | exp
        self.digits = 0
        self.violation: str | None = None

    def copy(self) -> JsonGuard:
        g = JsonGuard.__new__(JsonGuard)
        g.__dict__.update(self.__dict__)
        g.stack = [f.copy() for f in self.stack]
        g.raw = bytearray(self.raw)
        return g

    # ------------------------------------------------------------------ lexing
    def feed(self, data: bytes) -> bool:
        """Reads `data`; False (and `violation` set) at the first byte that breaks a rule."""
        for b in data:
            if not self._byte(b):
                return False
        return True

    def _after_value(self) -> None:
        self.mode = "after"

    def _byte(self, b: int) -> bool:
        mode = self.mode
        if mode == "string":
            if self.esc:
                self.esc = False
                self.raw.append(b)
                return True
            if b == 0x5C:  # backslash
                self.esc = True
                self.raw.append(b)
                return True
            if b == QUOTE:
                if self.is_key:
                    key = _decode(self.raw)
                    keys = self.stack[-1].seen if self.stack else set()
                    if key in keys:
                        self.violation = f"duplicate key {key!r}"
                        return False
                    keys.add(key)
                    if self.stack:
                        self.stack[-1].key = key
                    self.mode = "colon"
                    return True
                self._after_value()
                return self._item(("s", _decode(self.raw)))
            self.raw.append(b)
            if not self.is_key and not self._may_differ("s"):
                return False
            if b & 0xC0 != 0x80:  # a character starts here (UTF-8)
                self.chars += 1
                if self.chars > (MAX_KEY_CHARS if self.is_key else MAX_STRING_CHARS):
                    self.violation = "string too long"
                    return False
            return True
        if mode == "number":
            if 48 <= b <= 57:
                self.raw.append(b)
                if not self._may_differ("t"):
                    return False
                self.digits += 1
                cap = {"int": MAX_INT_DIGITS, "frac": MAX_FRAC_DIGITS, "exp": MAX_EXP_DIGITS}[self.seg]
                if self.digits > cap:
                    self.violation = f"number too long ({self.seg} digits)"
                    return False
                return True
            if b == ord(".") and self.seg == "int":
                self.raw.append(b)
                self.seg, self.digits = "frac", 0
                return True
            if b in (ord("e"), ord("E")) and self.seg != "exp":
                self.raw.append(b)
                self.seg, self.digits = "exp", 0
                return True
            if b in (ord("+"), ord("-")) and self.seg == "exp" and self.digits == 0:
                self.raw.append(b)
                return True
            self.mode = "after"
            return self._item(("n", _number(self.raw))) and self._byte(b)
        if mode == "literal":
            if 97 <= b <= 122:
                self.raw.append(b)
                return self._may_differ("t")
            self.mode = "after"
            return self._item(("l", bytes(self.raw))) and self._byte(b)
        if b in (0x20, 0x0A, 0x0D, 0x09):
            return True
        if mode in ("value", "key", "after", "colon"):
            if b == QUOTE and mode in ("value", "key"):
                self.mode, self.is_key, self.raw, self.esc, self.chars = "string", mode == "key", bytearray(), False, 0
                if mode == "value" and not self._may_differ("s"):
                    return False
            elif b == ord("{") and mode == "value":
                self.stack.append(Frame("obj"))
                self.mode = "key"
            elif b == ord("[") and mode == "value":
                path = self._path() if self.unique else None
                if path in self.unique:
                    vals = self.unique[path]
                    self.stack.append(Frame("arr", True, None if vals is None else tuple(_tagged(v) for v in vals)))
                else:
                    self.stack.append(Frame("arr"))
                self.mode = "value"
            elif b in (ord("}"), ord("]")) and mode in ("after", "key", "value"):
                if self.stack:
                    self.stack.pop()
                self.mode = "after"
            elif b == ord(",") and mode == "after":
                self.mode = "key" if self.stack and self.stack[-1].kind == "obj" else "value"
            elif b == ord(":") and mode == "colon":
                self.mode = "value"
            elif mode == "value" and (b == ord("-") or 48 <= b <= 57):
                self.mode, self.seg, self.digits, self.raw = "number", "int", 0, bytearray([b])
                if b != ord("-"):
                    self.digits = 1
                return self._may_differ("t")
            elif mode == "value" and 97 <= b <= 122:
                self.mode, self.raw = "literal", bytearray([b])
                return self._may_differ("t")
            # anything else is the grammar's business (it has already accepted the text)
        return True

    def _path(self) -> tuple[str, ...]:
        return tuple("*" if f.kind == "arr" else (f.key or "") for f in self.stack)

    def _in_unique(self) -> bool:
        return bool(self.stack) and self.stack[-1].unique

    def _may_differ(self, kind: str) -> bool:
        """In a unique array over a known item set: the item begun (`raw`, a string's or a number's or literal's
        text) can still become an item not yet written."""
        if not self._in_unique() or self.stack[-1].values is None:
            return True
        frame = self.stack[-1]
        if kind == "s":
            if self.esc or self.raw.endswith(b"\\"):
                return True
            try:
                prefix = bytes(self.raw).decode("utf-8")
                prefix = json.loads('"' + prefix + '"') if "\\" in prefix else prefix
            except ValueError:   # a partial UTF-8 character or escape: decided at the next byte
                return True
        else:
            prefix = self.raw.decode("latin-1")
        for tag, v, text in frame.values:
            if (tag, v) in frame.seen or (tag == "s") != (kind == "s"):
                continue
            if (v if kind == "s" else text).startswith(prefix):
                return True
        self.violation = f"every item starting {prefix!r} is already in the array (uniqueItems)"
        return False

    def _item(self, value: tuple) -> bool:
        """A scalar value just ended: in a unique array it must differ from the earlier items."""
        if not self._in_unique():
            return True
        seen = self.stack[-1].seen
        if value in seen:
            self.violation = f"repeated item {value[1]!r} in an array with uniqueItems"
            return False
        seen.add(value)
        return True

    # ------------------------------------------------------------------ masks
    def allows(self, token: bytes) -> bool:
        return self.copy().feed(token)

    def restrict(self, allowed: Tensor, facts: TokenFacts) -> Tensor:
        """`allowed` [V] bool minus the tokens this guard bans here; unchanged where that would leave none."""
        ban = None
        if self.mode in ("string", "number") and self.violation:
            return allowed
        if self.mode == "string":
            cap = MAX_KEY_CHARS if self.is_key else MAX_STRING_CHARS
            if self.chars >= cap:
                ban = ~facts.has_quote[: allowed.numel()]
            if self.is_key or self._in_unique():
                ban = self._ban_failing(facts.quote_ids, allowed, facts, ban)
        elif self.mode == "number":
            cap = {"int": MAX_INT_DIGITS, "frac": MAX_FRAC_DIGITS, "exp": MAX_EXP_DIGITS}[self.seg]
            ban = facts.lead_digits[: allowed.numel()] > max(0, cap - self.digits)
        if self._in_unique() and (self.mode in ("value", "number", "literal") or self.stack[-1].values):
            # tokens that would end an item (any token, where the item set is known: a prefix can be a repeat)
            ids = facts.ends_ids if self.stack[-1].values is None else allowed.nonzero().flatten()
            ban = self._ban_failing(ids, allowed, facts, ban)
        if ban is None:
            return allowed
        kept = allowed & ~ban
        return kept if bool(kept.any()) else allowed

    def _ban_failing(self, ids: Tensor, allowed: Tensor, facts: TokenFacts, ban: Tensor | None) -> Tensor | None:
        """`ban` plus those of the allowed token `ids` whose bytes this guard refuses here."""
        ids = ids[ids < allowed.numel()]
        ids = ids[allowed[ids]]
        bad = [i for i in ids.tolist() if not self.allows(facts.bytes[i])]
        if not bad:
            return ban
        extra = torch.zeros_like(allowed)
        extra[bad] = True
        return extra if ban is None else ban | extra


def _tagged(v) -> tuple:
    """(tag, hashable value, its JSON text) of an item value, as `_item` records items."""
    if isinstance(v, str):
        return "s", v, json.dumps(v, ensure_ascii=False)
    if isinstance(v, bool) or v is None:
        return "l", json.dumps(v).encode(), json.dumps(v)
    return "n", v, json.dumps(v)


def _number(raw: bytearray):
    try:
        return json.loads(bytes(raw))   # 1 and 1.0 are one value (equal, and hashed alike)
    except ValueError:
        return bytes(raw)


def _decode(raw: bytearray) -> str:
    try:
        return json.loads(b'"' + bytes(raw) + b'"')
    except ValueError:
        return bytes(raw).decode("utf-8", "replace")
