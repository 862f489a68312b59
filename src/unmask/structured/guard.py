"""What a JSON grammar cannot say and a JSON answer must still respect, checked while decoding.

llguidance's JSON grammar is context-free: it cannot forbid an object key that was already written
(`{"B": 1, "B": 2}` is grammatical wherever other keys are allowed), nor does it bound numbers or strings
the schema leaves unbounded. `JsonGuard` reads the committed JSON text byte by byte (a small lexer: the
container stack, the keys of each open object, the string or number being written) and bans the tokens
that would:

  - close an object key equal to one already in that object (the key must then go on, or differ);
  - write more than MAX_INT_DIGITS digits before a number's point, MAX_FRAC_DIGITS after it, or
    MAX_EXP_DIGITS in its exponent;
  - write more than MAX_KEY_CHARS characters in a key, or MAX_STRING_CHARS in a string value.

The bans are soft: where they would leave no grammatical token at all (a schema that demands a
longer string, say), the grammar's own mask is used unchanged. Forced text and the budget closer are
not screened (the grammar leaves them no choice).
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


class TokenFacts:
    """Per-token facts the guard's masks need, built once per tokenizer."""

    def __init__(self, token_bytes: list[bytes]):
        self.bytes = token_bytes
        self.has_quote = torch.tensor([QUOTE in b for b in token_bytes], dtype=torch.bool)
        self.lead_digits = torch.tensor([len(b) - len(b.lstrip(b"0123456789")) for b in token_bytes])
        self.quote_ids = self.has_quote.nonzero().flatten()


class JsonGuard:
    """Lexer state after the committed text. `mode`: value (a value may start), key (a key or `}`), colon,
    after (`,` or a close), string, number, literal."""

    def __init__(self):
        self.stack: list[tuple[str, set[str]]] = []   # ("obj", keys) | ("arr", unused)
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
        g.stack = [(k, set(s)) for k, s in self.stack]
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
                    keys = self.stack[-1][1] if self.stack else set()
                    if key in keys:
                        self.violation = f"duplicate key {key!r}"
                        return False
                    keys.add(key)
                    self.mode = "colon"
                else:
                    self._after_value()
                return True
            self.raw.append(b)
            if b & 0xC0 != 0x80:  # a character starts here (UTF-8)
                self.chars += 1
                if self.chars > (MAX_KEY_CHARS if self.is_key else MAX_STRING_CHARS):
                    self.violation = "string too long"
                    return False
            return True
        if mode == "number":
            if 48 <= b <= 57:
                self.digits += 1
                cap = {"int": MAX_INT_DIGITS, "frac": MAX_FRAC_DIGITS, "exp": MAX_EXP_DIGITS}[self.seg]
                if self.digits > cap:
                    self.violation = f"number too long ({self.seg} digits)"
                    return False
                return True
            if b == ord(".") and self.seg == "int":
                self.seg, self.digits = "frac", 0
                return True
            if b in (ord("e"), ord("E")) and self.seg != "exp":
                self.seg, self.digits = "exp", 0
                return True
            if b in (ord("+"), ord("-")) and self.seg == "exp" and self.digits == 0:
                return True
            self.mode = "after"
            return self._byte(b)
        if mode == "literal":
            if 97 <= b <= 122:
                return True
            self.mode = "after"
            return self._byte(b)
        if b in (0x20, 0x0A, 0x0D, 0x09):
            return True
        if mode in ("value", "key", "after", "colon"):
            if b == QUOTE and mode in ("value", "key"):
                self.mode, self.is_key, self.raw, self.esc, self.chars = "string", mode == "key", bytearray(), False, 0
            elif b == ord("{") and mode == "value":
                self.stack.append(("obj", set()))
                self.mode = "key"
            elif b == ord("[") and mode == "value":
                self.stack.append(("arr", set()))
                self.mode = "value"
            elif b in (ord("}"), ord("]")) and mode in ("after", "key", "value"):
                if self.stack:
                    self.stack.pop()
                self.mode = "after"
            elif b == ord(",") and mode == "after":
                self.mode = "key" if self.stack and self.stack[-1][0] == "obj" else "value"
            elif b == ord(":") and mode == "colon":
                self.mode = "value"
            elif mode == "value" and (b == ord("-") or 48 <= b <= 57):
                self.mode, self.seg, self.digits = "number", "int", 0
                if b != ord("-"):
                    self.digits = 1
            elif mode == "value" and 97 <= b <= 122:
                self.mode = "literal"
            # anything else is the grammar's business (it has already accepted the text)
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
            if self.is_key:
                ids = facts.quote_ids[facts.quote_ids < allowed.numel()]
                ids = ids[allowed[ids]]
                bad = [i for i in ids.tolist() if not self.allows(facts.bytes[i])]
                if bad:
                    extra = torch.zeros_like(allowed)
                    extra[bad] = True
                    ban = extra if ban is None else ban | extra
        elif self.mode == "number":
            cap = {"int": MAX_INT_DIGITS, "frac": MAX_FRAC_DIGITS, "exp": MAX_EXP_DIGITS}[self.seg]
            ban = facts.lead_digits[: allowed.numel()] > max(0, cap - self.digits)
        if ban is None:
            return allowed
        kept = allowed & ~ban
        return kept if bool(kept.any()) else allowed


def _decode(raw: bytearray) -> str:
    try:
        return json.loads(b'"' + bytes(raw) + b'"')
    except ValueError:
        return bytes(raw).decode("utf-8", "replace")
