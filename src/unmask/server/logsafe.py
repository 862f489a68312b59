"""Client-sent text made safe to log: one line, bounded length.

A request can carry any characters in a field name or a URL path. Written to the log raw, a newline in
one forges a whole log line (`"zz\\nINFO: ... GET /forged"` reads as an access-log entry), and a megabyte
name fills the log. Every string a client controls goes through `clean` (or `names`) before a logger sees
it: control and format characters (line and paragraph separators, ANSI escapes, bidi overrides, ...)
are written as Python escapes (`\\n`, `\\x1b`, `\\u2028`), a backslash as `\\\\` so that an escape in
the log always means an escaped character, and the text is cut at `limit` characters.
"""
from __future__ import annotations

import unicodedata
from collections.abc import Iterable

NAME_LIMIT = 64      # characters kept of one client-sent name or path
NAMES_LIMIT = 10     # names listed in one log line; the rest are counted

_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    # C*: control, format, surrogate, private use, unassigned; Z[lp]: line and paragraph separators
    category = unicodedata.category(ch)
    if category[0] == "C" or category in ("Zl", "Zp"):
        code = ord(ch)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    return ch


def clean(text: object, limit: int = NAME_LIMIT) -> str:
    """`text` as one printable line of at most `limit` characters of the original (plus a cut marker)."""
    text = str(text)
    cut = len(text) - limit
    out = "".join(_escape(ch) for ch in text[:limit])
    return f"{out}...(+{cut} chars)" if cut > 0 else out


def names(items: Iterable[object], limit: int = NAMES_LIMIT) -> str:
    """A comma-separated list of cleaned names, at most `limit` of them."""
    items = list(items)
    shown = ", ".join(clean(x) for x in items[:limit])
    return f"{shown} (+{len(items) - limit} more)" if len(items) > limit else shown
