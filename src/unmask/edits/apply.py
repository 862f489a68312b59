"""Apply-edit: merge a lazy update snippet into the original code.

The request holds `<|original_code|>...<|/original_code|>` and `<|update_snippet|>...<|/update_snippet|>`.
A snippet shows the changed code plus enough unchanged lines to locate it; everything else is elided
with marker lines such as `// ... existing code ...` or `# ... rest of the file ...`.

Deterministic part (`plan_merge`):

 1. Markers: a line that is only a comment opener and `...` (`// ...`, `# ... existing code ...`,
    `/* ... */`, `<!-- ... -->`), or a comment naming existing / unchanged / the rest of the code.
    A bare `...` is code (Python's Ellipsis), not a marker.
 2. Anchors: snippet lines matched to original lines, in order (difflib on whitespace-stripped lines;
    blank lines never anchor). A match is kept if it is part of a run of two or more matched lines
    that holds a line with at least three letters or digits, or if the line is that distinctive and
    unique in both texts (a lone `}` or `return x` does not anchor).
 3. The indentation of new lines is corrected by the offset of the nearest anchor before them (else
    after them): a snippet written without its class' indentation is re-indented to it.
 4. Between two anchors (the file's start and end count as anchors that are preceded / followed by
    an implicit marker, so the head and tail of a file are never dropped because the snippet did
    not show them), the snippet lines decide:
      - markers only                   -> the original lines are kept
      - nothing (anchors adjacent)     -> the original lines are deleted (kept if they are all blank)
      - new lines, no marker           -> the new lines replace the original ones
      - new lines, then a marker       -> new lines first, original lines after them
      - a marker, then new lines       -> original lines first, new lines after them
      - new lines between markers      -> AMBIGUOUS: where inside the kept lines they go
    A snippet with no marker at all is the complete new code.

What the model decides (the `Choice` pieces; every other byte of the answer is fixed):
  - placement: new lines between markers (or a snippet with no anchor at all) can go at any block
    boundary of the elided lines (after a blank line, before a dedent, at either end; at most
    MAX_PLACEMENTS), with or without a blank line separating them, and, when no anchor fixes their
    indentation, at the indentation of the line before or after the boundary or as written;
  - modification vs insertion: when the first (or last) new line next to a marker closely resembles
    an original line it would be inserted next to (difflib ratio >= SIMILAR but not equal), the new
    lines may instead replace the original lines from that one to the anchor.
The default option (used when the model is not consulted) is the literal reading: placement at the
end of the elided lines, insertion rather than replacement, anchor indentation.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from unmask.edits.plan import Choice, EditPlan, Fixed, Piece, section
from unmask.errors import InvalidRequestError

SIMILAR = 0.6           # difflib ratio above which a new line is taken as a modified original line
MAX_PLACEMENTS = 8      # block boundaries offered for an ambiguous insertion
MAX_OPTIONS = 32        # options of one Choice

_OPEN = r"(?://+|#+|--|;+|/\*+|<!--|\{/\*|\*|%|')"
_CLOSE = r"(?:\*+/\}?|-->)"
_DOTS = r"(?:\.{3,}|…)"
_MARKER_DOTS = re.compile(
    rf"^\s*(?P<open>{_OPEN})?\s*{_DOTS}\s*(?P<words>[^.…]*?)\s*(?:{_DOTS})?\s*(?:{_CLOSE})?\s*$")
_MARKER_WORDS = re.compile(
    rf"^\s*{_OPEN}\s*(?:{_DOTS}\s*)?(?:(?:keep|rest of|remaining)\s+(?:the\s+)?)?"
    rf"(?:existing|unchanged|rest of|remaining|other)\b[\w\s,'()/-]*(?:{_DOTS})?\s*(?:{_CLOSE})?\s*$", re.IGNORECASE)


def is_marker(line: str) -> bool:
    m = _MARKER_DOTS.match(line)
    if m and (m.group("open") or m.group("words")):
        return True
    return bool(_MARKER_WORDS.match(line))


def parse_apply_prompt(content: str) -> tuple[str, str]:
    original = section(content, "original_code")
    snippet = section(content, "update_snippet")
    if original is None or snippet is None:
        missing = [t for t, v in (("<|original_code|>", original), ("<|update_snippet|>", snippet)) if v is None]
        raise InvalidRequestError(f"the user message must hold <|original_code|>...<|/original_code|> and "
                                  f"<|update_snippet|>...<|/update_snippet|>; missing {', '.join(missing)}",
                                  "messages")
    return original, snippet


# ---------------------------------------------------------------------------------------- helpers
def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _alnum(line: str) -> int:
    return sum(c.isalnum() for c in line)


def _reindent(lines: list[str], frm: str, to: str) -> list[str]:
    if frm == to:
        return list(lines)
    out = []
    for ln in lines:
        if ln.strip() and ln.startswith(frm):
            out.append(to + ln[len(frm):])
        elif ln.strip() and frm.startswith(_indent(ln)) and len(to) >= len(frm) - len(_indent(ln)):
            out.append(to[:len(to) - (len(frm) - len(_indent(ln)))] + ln.lstrip())  # less indented than frm
        else:
            out.append(ln)
    return out


def _join(lines: list[str], nl_last: bool) -> str:
    if not lines:
        return ""
    return "\n".join(lines) + ("\n" if nl_last else "")


@dataclass
class _Anchor:
    o: int
    u: int


def _anchors(orig: list[str], snip: list[str], markers: list[bool]) -> list[_Anchor]:
    okey = [ln.strip() if ln.strip() else f"\0o{i}" for i, ln in enumerate(orig)]
    ukey = [ln.strip() if ln.strip() and not markers[j] else f"\0u{j}" for j, ln in enumerate(snip)]
    count_o: dict[str, int] = {}
    count_u: dict[str, int] = {}
    for k in okey:
        count_o[k] = count_o.get(k, 0) + 1
    for k in ukey:
        count_u[k] = count_u.get(k, 0) + 1
    blocks = [blk for blk in difflib.SequenceMatcher(None, okey, ukey, autojunk=False).get_matching_blocks()
              if blk.size]
    matched = {blk.b + t for blk in blocks for t in range(blk.size)}
    out = []
    for a, b, size in blocks:
        keys = okey[a:a + size]
        distinctive = [k for k in keys if _alnum(k) >= 3]
        unique = count_o[keys[0]] == 1 and count_u[keys[0]] == 1
        strong = bool(distinctive) and (size >= 2 or unique)
        if strong and not _inside_new_block(snip, markers, matched, b):
            out.extend(_Anchor(a + t, b + t) for t in range(size))
    return out


def _inside_new_block(snip: list[str], markers: list[bool], matched: set[int], j: int) -> bool:
    """Snippet line j lies in the body of a block the snippet adds: walking up over new lines, one is
    less indented than j before any matched line or marker (`return result` of a new method)."""
    width = len(_indent(snip[j]))
    for i in range(j - 1, -1, -1):
        if markers[i] or i in matched:
            return False
        if snip[i].strip() and len(_indent(snip[i])) < width:
            return True
    return False


EXPLICIT, IMPLICIT = "marker", "file edge"   # a marker line of the snippet / the start or end of the file


def _runs(items: list[str]) -> list[list[str] | str]:
    """Snippet lines of a gap as runs of new lines (lists) and markers (EXPLICIT / IMPLICIT); blank-only
    runs dropped, blank lines at a run's edge next to a marker dropped, neighbouring markers merged
    (an explicit one wins: it says the code there is kept)."""
    out: list[list[str] | str] = []
    for it in items:
        if it in (EXPLICIT, IMPLICIT):
            out.append(it)
        elif out and isinstance(out[-1], list):
            out[-1].append(it)
        else:
            out.append([it])
    clean: list[list[str] | str] = []
    for k, r in enumerate(out):
        if isinstance(r, list):
            r = list(r)
            if k > 0 and isinstance(out[k - 1], str):
                while r and not r[0].strip():
                    r.pop(0)
            if k + 1 < len(out) and isinstance(out[k + 1], str):
                while r and not r[-1].strip():
                    r.pop()
            if not any(ln.strip() for ln in r):
                continue
        if isinstance(r, str) and clean and isinstance(clean[-1], str):
            clean[-1] = EXPLICIT if EXPLICIT in (r, clean[-1]) else IMPLICIT
            continue
        clean.append(r)
    return clean


def _boundaries(gap: list[str], before: str | None) -> list[int]:
    """Block boundaries inside the elided lines: ends, after a blank line, before a dedent."""
    cands = [0]
    prev = before
    for b in range(1, len(gap) + 1):
        line_prev = gap[b - 1]
        if line_prev.strip():
            prev = line_prev
        nxt = gap[b] if b < len(gap) else None
        if b == len(gap) or not line_prev.strip() and (nxt is None or nxt.strip()):
            cands.append(b)
        elif nxt is not None and nxt.strip() and prev is not None and len(_indent(nxt)) < len(_indent(prev)):
            cands.append(b)
    cands = sorted(set(cands))
    if len(cands) > MAX_PLACEMENTS:  # evenly spread, both ends kept
        step = (len(cands) - 1) / (MAX_PLACEMENTS - 1)
        cands = sorted({cands[round(i * step)] for i in range(MAX_PLACEMENTS)})
    return cands


def _similar(a: str, b: str) -> bool:
    a, b = a.strip(), b.strip()
    return a != b and bool(a) and bool(b) and difflib.SequenceMatcher(None, a, b).ratio() >= SIMILAR


# ---------------------------------------------------------------------------------------- the merge
def plan_merge(original: str, snippet: str) -> EditPlan:
    orig = original.split("\n") if original else []
    snip = snippet.split("\n")
    nl_last = original.endswith("\n")
    if nl_last:
        orig = orig[:-1]
    if snippet.endswith("\n"):
        snip = snip[:-1]
    markers = [is_marker(s) for s in snip]
    if not any(markers):  # no elision: the snippet is the whole new code
        return EditPlan([Fixed(snippet)], notes=["the snippet has no markers: it is the complete new code"])
    anchors = _anchors(orig, snip, markers)
    offsets = [(_indent(orig[a.o]), _indent(snip[a.u])) for a in anchors]
    bounds = [_Anchor(-1, -1), *anchors, _Anchor(len(orig), len(snip))]

    pieces: list[Piece] = []
    buf: list[str] = []       # fixed lines not yet emitted

    def flush_with(piece: Choice | None):
        nonlocal buf
        if buf:
            pieces.append(Fixed("".join(ln + "\n" for ln in buf)))
            buf = []
        if piece is not None:
            pieces.append(piece)

    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        gap = orig[lo.o + 1:hi.o]
        items = [EXPLICIT if markers[j] else snip[j] for j in range(lo.u + 1, hi.u)]
        if k == 0:
            items.insert(0, IMPLICIT)      # the file's start: as if preceded by a marker
        if k == len(bounds) - 2:
            items.append(IMPLICIT)         # the file's end: as if followed by a marker
        # indentation offset: the nearest anchor before the gap, else the one after it
        off = offsets[k - 1] if k > 0 else offsets[k] if k < len(offsets) else None
        fix = (lambda ls, off=off: _reindent(ls, off[1], off[0])) if off is not None else list
        runs = _runs(items)
        new = [r for r in runs if isinstance(r, list)]
        marks = [r for r in runs if isinstance(r, str)]
        if not new:
            if marks or all(not g.strip() for g in gap):
                buf.extend(gap)            # kept (elided by a marker, or only blank lines between anchors)
            # else: anchors adjacent in the snippet -> the original lines between them are deleted
        elif not marks:
            buf.extend(fix(new[0]))        # replaced (no marker: the snippet shows this stretch whole)
        else:
            lead = runs[0] if isinstance(runs[0], list) else None
            trail = runs[-1] if isinstance(runs[-1], list) and len(runs) > 1 else None
            inner = [ln for r in runs[1:-1] if isinstance(r, list) for ln in r]
            choice = None
            if lead is not None and not inner and trail is None:
                choice = _edge_choice(gap, fix(lead), at_start=True, implicit=runs[-1] == IMPLICIT)
            elif trail is not None and not inner and lead is None:
                choice = _edge_choice(gap, fix(trail), at_start=False, implicit=runs[0] == IMPLICIT)
            if choice is not None:
                flush_with(choice)
            elif not inner:
                buf.extend((fix(lead) if lead else []) + gap + (fix(trail) if trail else []))
            else:
                buf.extend(fix(lead) if lead else [])
                before_line = orig[lo.o] if lo.o >= 0 else None
                after_line = orig[hi.o] if hi.o < len(orig) else None
                placed = _placement_choice(gap, inner, fix if off is not None else None, before_line, after_line)
                # at the file's edge (no marker says the code there is kept) the new lines may modify a line
                edge = runs[0] == IMPLICIT or runs[-1] == IMPLICIT
                flush_with(_with_modify(placed, gap, inner) if edge else placed)
                buf.extend(fix(trail) if trail else [])
        if hi.o < len(orig):
            buf.append(orig[hi.o])
    flush_with(None)
    plan = EditPlan(pieces)
    _restore_final_newline(plan, nl_last)
    return plan


def _edge_choice(gap: list[str], new: list[str], at_start: bool, implicit: bool) -> Choice | None:
    """New lines on one side of elided lines (`at_start`: before them). Default: inserted there. The
    alternatives: they replace the elided lines from the one the nearest new line resembles (within the
    block they join) up to that side; and when the elided lines are the file's head or tail that the
    snippet merely did not show (`implicit`), they replace the elided lines up to any block boundary."""
    insert = new + gap if at_start else gap + new
    if at_start:  # resembling lines are looked for in the block the new lines join, not past its end
        width = len(_indent(next(ln for ln in new if ln.strip())))
        reach = next((t for t, g in enumerate(gap) if g.strip() and len(_indent(g)) < width), len(gap))
        cuts = [t + 1 for t, g in enumerate(gap[:reach]) if _similar(new[-1], g)][:3]
    else:
        width = len(_indent(next(ln for ln in reversed(new) if ln.strip())))
        reach = next((t + 1 for t in range(len(gap) - 1, -1, -1)
                      if gap[t].strip() and len(_indent(gap[t])) < width), 0)
        cuts = [reach + t for t, g in enumerate(gap[reach:]) if _similar(new[0], g)][-3:]
    if implicit and gap:
        bounds = _boundaries(gap, None)
        cuts += [b for b in bounds if b not in (0, len(gap))] + [len(gap) if at_start else 0]
    if at_start:
        alts = [new + gap[c:] for c in sorted(set(cuts))]
    else:
        alts = [gap[:c] + new for c in sorted(set(cuts), reverse=True)]
    options = _dedupe([_lines(o) for o in [insert, *alts]])[:MAX_OPTIONS]
    if len(options) < 2:
        return None
    why = ("new lines next to the file's unshown head or tail: insert them, or replace the unshown lines"
           if implicit else "new lines next to a marker resemble an original line: modify it, or insert beside it")
    return Choice(tuple(options), why)


def _with_modify(placed: Choice | Fixed, gap: list[str], new: list[str]) -> Choice | Fixed:
    """New lines between a marker and the file's unshown start or end may also change an elided line they
    resemble (a snippet that shows only the changed `return` of a function): besides each placement, options
    that replace that line in place, at its indentation, right after the default placement."""
    spots = [t for t, g in enumerate(gap) if _similar(new[0], g)][:3]
    if not spots:
        return placed
    first = next(ln for ln in new if ln.strip())
    modified = [_lines(gap[:t] + _reindent(new, _indent(first), _indent(gap[t])) + gap[t + len(new):]) for t in spots]
    current = placed.options if isinstance(placed, Choice) else (placed.text,)
    options = _dedupe([current[0], *modified, *current[1:]])[:MAX_OPTIONS]
    why = placed.why if isinstance(placed, Choice) else ""
    return Choice(tuple(options), (why + "; " if why else "") + "or modify the elided line they resemble")


def _placement_choice(gap: list[str], new: list[str], fix, before_line: str | None,
                      after_line: str | None) -> Choice | Fixed:
    opts: list[str] = []
    default_first: list[str] = []
    bounds = _boundaries(gap, before_line)
    for b in reversed(bounds):    # the end first: the literal reading, the default
        prev_ln = next((g for g in reversed(gap[:b]) if g.strip()), before_line)
        next_ln = next((g for g in gap[b:] if g.strip()), after_line)
        variants = [fix(new)] if fix is not None else _indent_variants(new, gap, b, prev_ln, next_ln, before_line)
        for v in variants:
            plain = gap[:b] + v + gap[b:]
            pad_before = b > 0 and gap[b - 1].strip() or b == 0 and before_line is not None and before_line.strip()
            pad_after = b < len(gap) and gap[b].strip()
            padded = gap[:b] + ([""] if pad_before else []) + v + ([""] if pad_after else []) + gap[b:]
            for o in (plain, padded):
                opts.append(_lines(o))
                if not default_first:
                    default_first.append(opts[-1])
    options = _dedupe(opts)[:MAX_OPTIONS]
    if len(options) == 1:
        return Fixed(options[0])
    return Choice(tuple(options), "new lines between markers: where (and at which indentation) they go")


def _indent_variants(new: list[str], gap: list[str], b: int, prev_ln: str | None, next_ln: str | None,
                     before_line: str | None) -> list[list[str]]:
    """New lines whose indentation no anchor fixes, re-based to: the line before the boundary, the block
    header enclosing it (first when the new code itself opens a block: a sibling of that block), the
    line after it, or as written."""
    first = next(ln for ln in new if ln.strip())
    base = _indent(first)
    levels = []
    header = None
    if prev_ln is not None:
        width = len(_indent(prev_ln))
        header = next((g for g in reversed([before_line or "", *gap[:b]]) if g.strip() and len(_indent(g)) < width),
                      None)
    opens_block = first.rstrip().endswith((":", "{"))
    for ln in ((header, prev_ln) if opens_block else (prev_ln, header)) + (next_ln,):
        if ln is not None:
            levels.append(_indent(ln))
    levels.append(base)
    out = []
    for lvl in dict.fromkeys(levels):
        out.append(_reindent(new, base, lvl))
    return out


def _lines(lines: list[str]) -> str:
    return "".join(ln + "\n" for ln in lines)


def _dedupe(options: list[str]) -> list[str]:
    seen, out = set(), []
    for o in options:
        if o not in seen:
            seen.add(o)
            out.append(o)
    return out


def _restore_final_newline(plan: EditPlan, nl_last: bool) -> None:
    """Pieces are built line by line with a newline after each; drop the last one if the original had none."""
    if nl_last or not plan.pieces:
        return
    last = plan.pieces[-1]
    if isinstance(last, Fixed):
        if last.text.endswith("\n"):
            plan.pieces[-1] = Fixed(last.text[:-1])
    else:
        opts = tuple(o[:-1] if o.endswith("\n") else o for o in last.options)
        plan.pieces[-1] = Choice(opts, last.why) if len(set(opts)) == len(opts) else Fixed(opts[0])
