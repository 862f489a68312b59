"""server/frames.py: a `diffusing` frame's text and the spans of what its step committed and revised."""
from __future__ import annotations

from unmask.server.frames import MASK_PLACEHOLDER as M, render_frame

MASK = 0
# a byte-level vocabulary: token -> bytes (5 and 6 are the two halves of "é"), decoded together as a tokenizer does
VOCAB = {1: b"def", 2: b" f", 3: b"(x)", 4: b":", 5: b"\xc3", 6: b"\xa9", 7: b"\n", 8: b" return"}


def decode(ids):
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def spans(frame, kind):
    return [frame["text"][a:b] for a, b in frame[kind]]


def test_first_frame_marks_every_filled_token_committed():
    f = render_frame(decode, MASK, [1, 2, MASK, MASK, 4])
    assert f["text"] == f"def f{M}{M}:" and f["masked"] == 2
    assert spans(f, "committed") == ["def f", ":"] and f["edited"] == []


def test_committed_since_the_previous_frame_and_edited_this_step():
    prev = [1, 2, MASK, MASK, 4, MASK]
    # position 2 committed, 4 replaced (":" -> "(x)"), 5 still masked; 3 stays masked
    f = render_frame(decode, MASK, [1, 2, 3, MASK, 3, MASK], prev, edited=[4])
    assert f["text"] == f"def f(x){M}(x){M}"
    assert spans(f, "committed") == ["(x)"] and spans(f, "edited") == ["(x)"]
    assert f["committed"] == [[5, 8]] and f["edited"] == [[9, 12]]


def test_a_remasked_token_spans_its_placeholder_and_adjacent_tokens_merge():
    prev = [1, 2, 3, 4, MASK, MASK]
    f = render_frame(decode, MASK, [1, 2, MASK, 4, 7, 8], prev, edited=[2])
    assert f["text"] == f"def f{M}:\n return"
    assert spans(f, "edited") == [M] and spans(f, "committed") == ["\n return"]   # two tokens, one span


def test_offsets_count_code_points_and_survive_a_split_character():
    prev = [1, MASK, MASK, MASK]
    f = render_frame(decode, MASK, [1, 5, 6, 4], prev)          # "é" from two tokens, then ":"
    assert f["text"] == "defé:" and spans(f, "committed") == ["é:"]
    f = render_frame(decode, MASK, [1, 5, 6, 4], [1, 5, 6, MASK], edited=[2])
    # the prefix ending inside "é" decodes to a replacement character: offsets stay within the text, in order
    assert all(0 <= a <= b <= len(f["text"]) for a, b in f["edited"] + f["committed"])
    assert spans(f, "committed") == [":"]


def test_edited_positions_past_a_shorter_final_frame_are_dropped():
    f = render_frame(decode, MASK, [1, 4], [1, 4, 3, 3], edited=[3])
    assert f["edited"] == [] and f["committed"] == []
