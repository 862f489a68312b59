"""The `diffusing` frames' text: a choice's snapshot as text, and where in it this step changed (docs/server.md).

A frame is the committed prefix plus the active block, every masked position one MASK_PLACEHOLDER. Beside the text
it names, as [start, end) offsets in that text (Unicode code points), the tokens committed this step (a mask that
became a token since the choice's previous frame) and the tokens this step revised (replaced by an edit, or put
back to mask: the engine's `StepOutput.edited`), so a client marks them exactly instead of diffing strings whose
lengths change as tokens resolve.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import groupby

MASK_PLACEHOLDER = "░"   # U+2591, one per masked position


def render_frame(decode: Callable[[list[int]], str], mask_id: int, snapshot: Sequence[int],
                 previous: Sequence[int] | None = None, edited: Sequence[int] = ()) -> dict:
    """{"text", "masked", "committed", "edited"}: `snapshot`'s text (runs of tokens decoded together, as a
    whole answer is), the masked count, and the spans of the positions committed since `previous` (the choice's
    last snapshot; None: the first frame, where every filled position is new) and of the `edited` positions."""
    prev = previous or ()
    changed = {i: "edited" for i in edited if 0 <= i < len(snapshot)}
    for i, t in enumerate(snapshot):
        if t != mask_id and i not in changed and (i >= len(prev) or prev[i] == mask_id):
            changed[i] = "committed"
    parts: list[str] = []
    spans: dict[str, list[list[int]]] = {"committed": [], "edited": []}
    at = masked = pos = 0
    for is_mask, group in groupby(snapshot, key=lambda t: t == mask_id):
        run = list(group)
        if is_mask:
            text = MASK_PLACEHOLDER * len(run)
            masked += len(run)
            bounds = lambda j: j  # noqa: E731 - one character per masked token
        else:
            text = decode(run)
            bounds = _offsets(decode, run, text, [j - pos for j in changed if pos <= j < pos + len(run)])
        for j in range(len(run)):
            kind = changed.get(pos + j)
            if kind:
                start, end = at + bounds(j), at + bounds(j + 1)
                last = spans[kind][-1] if spans[kind] else None
                if last and last[1] == start:
                    last[1] = end        # adjacent tokens of one kind: one span
                elif end > start:
                    spans[kind].append([start, end])
        parts.append(text)
        at += len(text)
        pos += len(run)
    return {"text": "".join(parts), "masked": masked, **spans}


def _offsets(decode: Callable[[list[int]], str], run: list[int], text: str, wanted: list[int]) -> Callable[[int], int]:
    """Where token j of `run` starts in `text` (its decoding), for the j in `wanted` and j + 1: the length of the
    decoded prefix run[:j], kept within [0, len(text)] and non-decreasing (a prefix can end inside a character of
    several bytes, which decodes to a replacement character)."""
    cuts = sorted({c for j in wanted for c in (j, j + 1)})
    found: dict[int, int] = {}
    low = 0
    for c in cuts:
        low = found[c] = max(low, min(len(text), len(decode(run[:c])) if 0 < c < len(run) else (0 if c <= 0 else len(text))))
    return lambda j: found[j]
