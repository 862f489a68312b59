"""An edit as pieces of text: fixed text the model never touches, and regions the model decides.

Both edit endpoints reduce a request to an `EditPlan`:

  Fixed(text)        copied to the answer byte for byte
  Choice(options)    apply-edit: the merge is ambiguous here; the model picks one of the options
                     (options[0] is the deterministic default)
  Rewrite(original)  next-edit: the model rewrites this text freely (an infill between its neighbours)

`head` / `tail` are context the model reads before / after the pieces but that is not part of the
answer (other files, the rest of the current file). Every model-decided piece becomes one infill
request whose prefix is everything before it and whose suffix is everything after it, the other
pieces shown with their defaults; nothing else of the text is regenerated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fixed:
    text: str


@dataclass(frozen=True)
class Choice:
    options: tuple[str, ...]   # distinct; options[0] is the deterministic default
    why: str = ""

    @property
    def default(self) -> str:
        return self.options[0]


@dataclass(frozen=True)
class Rewrite:
    original: str
    why: str = ""

    @property
    def default(self) -> str:
        return self.original


Piece = Fixed | Choice | Rewrite


@dataclass
class EditPlan:
    pieces: list[Piece]
    head: str = ""
    tail: str = ""
    notes: list[str] = field(default_factory=list)

    def open_pieces(self) -> list[int]:
        """Indices of the pieces the model decides."""
        return [i for i, p in enumerate(self.pieces) if not isinstance(p, Fixed)]

    def text_of(self, piece: Piece) -> str:
        return piece.text if isinstance(piece, Fixed) else piece.default

    def render(self, answers: dict[int, str] | None = None) -> str:
        """The answer: fixed pieces verbatim, decided pieces from `answers` (default where absent)."""
        answers = answers or {}
        return "".join(answers.get(i, self.text_of(p)) for i, p in enumerate(self.pieces))

    def context(self, index: int) -> tuple[str, str]:
        """(before, after) of piece `index` as the model sees them: head + pieces before, pieces after + tail."""
        before = self.head + "".join(self.text_of(p) for p in self.pieces[:index])
        after = "".join(self.text_of(p) for p in self.pieces[index + 1:]) + self.tail
        return before, after


# ---------------------------------------------------------------------------------------- choices as infills
@dataclass(frozen=True)
class ChoiceInfill:
    """A Choice posed as an infill: the model writes one of `middles` between `before` and `after`."""

    before: str
    after: str
    middles: tuple[str, ...]   # aligned with the Choice's options; all distinct and non-empty

    def option_for(self, middle: str) -> int | None:
        try:
            return self.middles.index(middle)
        except ValueError:
            return None


def _split_lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def choice_infill(before: str, after: str, options: tuple[str, ...]) -> ChoiceInfill | None:
    """Move the lines all options share (at their start and end) into the context, so the model
    decides only where they differ; borrow a neighbouring line when an option would be empty (a
    grammar choice needs non-empty strings). None if the options cannot be told apart that way."""
    split = [_split_lines(o) for o in options]
    lead = 0
    while all(len(s) > lead for s in split) and len({s[lead] for s in split}) == 1:
        lead += 1
    trail = 0
    while all(len(s) - lead > trail for s in split) and len({s[len(s) - 1 - trail] for s in split}) == 1:
        trail += 1
    before += "".join(split[0][:lead])
    after = "".join(split[0][len(split[0]) - trail:] if trail else []) + after
    mids = ["".join(s[lead:len(s) - trail]) for s in split]
    if any(not m for m in mids):
        if after:  # borrow the next line into every option
            nxt = _split_lines(after)[0]
            mids, after = [m + nxt for m in mids], after[len(nxt):]
        elif before:
            prv = _split_lines(before)[-1]
            mids, before = [prv + m for m in mids], before[:len(before) - len(prv)]
        else:
            return None
    if len(set(mids)) != len(mids):
        return None
    return ChoiceInfill(before, after, tuple(mids))


# ---------------------------------------------------------------------------------------- prompt sections
def section(text: str, name: str) -> str | None:
    """Body of `<|name|>...<|/name|>` (closing tag optional: then up to the next section or the end),
    without the one newline that usually follows the opening tag and precedes the closing one."""
    start = text.find(f"<|{name}|>")
    if start < 0:
        return None
    start += len(name) + 4
    end = text.find(f"<|/{name}|>", start)
    if end < 0:
        nxt = re.search(r"<\|(?!cursor\|)[a-z_]+\|>", text[start:])
        end = start + nxt.start() if nxt else len(text)
    body = text[start:end]
    if body.startswith("\n"):
        body = body[1:]
    if body.endswith("\n"):
        body = body[:-1]
    return body


def strip_section(text: str, name: str) -> str:
    """`text` without the section `name` (tags and body)."""
    start = text.find(f"<|{name}|>")
    if start < 0:
        return text
    close = f"<|/{name}|>"
    end = text.find(close, start)
    return text[:start] + (text[end + len(close):] if end >= 0 else "")
