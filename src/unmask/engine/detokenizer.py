"""Append-only text for a stream of final tokens, with stop strings matched on the text."""
from __future__ import annotations

from unmask.tokenizer import Tokenizer


class TextStream:
    """Decodes a growing token list; holds back just enough text to never emit part of a stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, include_stop: bool = False,
                 min_tokens: int = 0):
        self.tok = tokenizer
        self.stop = stop or []
        self.min_tokens = min_tokens  # stop strings are matched only in the text after the first min_tokens tokens
        self._search_from: int | None = 0 if min_tokens == 0 else None
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.stop_end: int | None = None   # where the matched stop string ends in the text
        # decode from a recent window only: text before `prefix` tokens never changes again
        self._prefix_ids = 0
        self._prefix_text = ""

    def _decode(self) -> str:
        window = self.tok.decode(self.ids[self._prefix_ids:])
        text = self._prefix_text + window
        if len(self.ids) - self._prefix_ids > 64 and not window.endswith("\ufffd"):
            self._prefix_text, self._prefix_ids = text, len(self.ids) - 8
            self._prefix_text = text[: len(text) - len(self.tok.decode(self.ids[self._prefix_ids:]))]
        return text

    def push(self, ids: list[int]) -> str:
        if self.stopped or not ids:
            return ""
        self.ids.extend(ids)
        text = self._decode()
        if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            return ""
        self.text = text
        if self._search_from is None:
            if len(self.ids) < self.min_tokens:
                return self._release(text)
            self._search_from = len(self.tok.decode(self.ids[:self.min_tokens]))
        # the earliest match of any stop string ends the text (not the last string listed that matches)
        start = max(self._search_from, self.emitted - max((len(s) for s in self.stop), default=0))
        hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
        if hits:
            i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
            self.text, self.stopped = text[:i + len(s) if self.include_stop else i], True
            self.stop_end = i + len(s)
        return self._release(self.text)

    def tokens_through_stop(self) -> int:
        """After a stop string matched: how many of the tokens pushed so far it takes to write it. A step can
        commit several tokens, so the ones after the stop string are not part of the output."""
        k = len(self.ids)
        while k > 1 and len(self.tok.decode(self.ids[:k - 1]).rstrip("\ufffd")) >= self.stop_end:
            k -= 1
        return k

    def _release(self, text: str) -> str:
        safe = len(text) if self.stopped else max(self.emitted, len(text) - self.hold)
        delta, self.emitted = text[self.emitted:safe], safe
        return delta

    def flush(self) -> str:
        """At the end of generation: release what was held back for stop matching."""
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
