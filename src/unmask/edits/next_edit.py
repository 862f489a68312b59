"""Next edit: rewrite the region around the cursor the way the programmer's recent edits suggest.

The request is one user message with the sections

  <|recently_viewed_code_snippets|>  zero or more <|recently_viewed_code_snippet|> blocks, each starting
                                     with `code_snippet_file_path: PATH`
  <|current_file_content|>           `current_file_path: PATH`, then the file; the editable region may
                                     be marked inside it by a nested <|code_to_edit|> section
  <|code_to_edit|>                   the editable region, with <|cursor|> where the cursor is
  <|edit_diff_history|>              the recent edits as unified diffs (or free text)

and the answer is the code_to_edit region rewritten (without the cursor marker).

Edit by remasking: the region is split into lines the model may rewrite and lines it may not, and
only the former are regenerated, each as an infill with the rest of the file in view; every other
byte of the region comes back unchanged. Rewritten, in order (at most MAX_REWRITES):

  1. from the cursor to the end of its line (what the programmer typed before the cursor is kept;
     the model may also continue onto new lines there), the whole line if rule 2 also applies to it;
  2. whole lines that still use a name the diff history removed: an identifier present in the
     history's `-` lines and absent from its `+` lines (a rename or signature change not yet
     propagated to these lines).

Context the model reads: the recently viewed snippets' code (paths dropped), then the current file
with the region in place. The diff history itself only chooses the lines; it is not shown to the
model (it is not code, and the built-in model is trained on code and FIM only).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from unmask.edits.plan import EditPlan, Fixed, Rewrite, section, strip_section
from unmask.errors import InvalidRequestError

CURSOR = "<|cursor|>"
MAX_REWRITES = 8
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class NextEditRequest:
    code_to_edit: str            # the region, cursor marker removed
    cursor: int | None           # offset of the cursor in code_to_edit
    file_before: str             # the current file before the region
    file_after: str              # the current file after the region
    file_path: str | None
    snippets: list[str]          # recently viewed code
    history: str


def _snippets(body: str | None) -> list[str]:
    if not body:
        return []
    found = re.findall(r"<\|recently_viewed_code_snippet\|>\n?(.*?)\n?<\|/recently_viewed_code_snippet\|>", body, re.S)
    out = []
    for s in found:
        lines = s.split("\n")
        if lines and lines[0].startswith("code_snippet_file_path:"):
            lines = lines[1:]
        if "\n".join(lines).strip():
            out.append("\n".join(lines))
    return out


def parse_next_edit_prompt(content: str) -> NextEditRequest:
    file_body = section(content, "current_file_content")
    rest = strip_section(content, "current_file_content")
    region = section(file_body, "code_to_edit") if file_body is not None else None
    nested = region is not None
    if region is None:
        region = section(rest, "code_to_edit")
    if region is None:
        raise InvalidRequestError("the user message must hold a <|code_to_edit|>...<|/code_to_edit|> section "
                                  "(the region to rewrite, with <|cursor|>)", "messages")
    cursor = region.find(CURSOR)
    code = region.replace(CURSOR, "")
    path = None
    file_text = file_body or ""
    if file_text.startswith("current_file_path:"):
        first, _, file_text = file_text.partition("\n")
        path = first.split(":", 1)[1].strip() or None
    if nested:
        start = file_text.find("<|code_to_edit|>")
        close = file_text.find("<|/code_to_edit|>", start)
        before = file_text[:start]
        after = file_text[close + len("<|/code_to_edit|>"):] if close >= 0 else ""
        after = after[1:] if after.startswith("\n") else after
    else:
        file_text = file_text.replace(CURSOR, "")
        at = file_text.find(code) if code else -1
        if at >= 0:
            before, after = file_text[:at], file_text[at + len(code):]
        else:  # the region is not in the file as sent: the file is context before it
            before, after = (file_text + "\n" if file_text and not file_text.endswith("\n") else file_text), ""
    before, after = before.replace(CURSOR, ""), after.replace(CURSOR, "")
    return NextEditRequest(code, cursor if cursor >= 0 else None, before, after, path,
                           _snippets(section(rest, "recently_viewed_code_snippets")),
                           section(rest, "edit_diff_history") or "")


def removed_names(history: str) -> set[str]:
    """Identifiers the diff history removed: in `-` lines and in no `+` line."""
    minus, plus = set(), set()
    for line in history.split("\n"):
        if line.startswith("-") and not line.startswith("---"):
            minus.update(_IDENT.findall(line[1:]))
        elif line.startswith("+") and not line.startswith("+++"):
            plus.update(_IDENT.findall(line[1:]))
    return {n for n in minus - plus if len(n) >= 2}


def plan_next_edit(req: NextEditRequest) -> EditPlan:
    code = req.code_to_edit
    spans: list[tuple[int, int, str]] = []
    stale = removed_names(req.history)
    pattern = re.compile(r"\b(?:" + "|".join(sorted(map(re.escape, stale))) + r")\b") if stale else None
    if req.cursor is not None:
        eol = code.find("\n", req.cursor)
        eol = len(code) if eol < 0 else eol
        sol = code.rfind("\n", 0, req.cursor) + 1
        if pattern is not None and pattern.search(code[sol:eol]):
            spans.append((sol, eol, "the cursor's line, which uses a name the edit history removed"))
        else:
            spans.append((req.cursor, eol, "the cursor's line, from the cursor"))
    if pattern is not None:
        pos = 0
        for line in code.split("\n"):
            lo, hi = pos, pos + len(line)
            pos = hi + 1
            if pattern.search(line) and not any(a <= hi and lo <= b for a, b, _ in spans):
                spans.append((lo, hi, "uses a name the edit history removed"))
    spans = sorted(spans)[:MAX_REWRITES]
    pieces, at = [], 0
    for lo, hi, why in spans:
        if lo > at:
            pieces.append(Fixed(code[at:lo]))
        pieces.append(Rewrite(code[lo:hi], why))
        at = hi
    if at < len(code):
        pieces.append(Fixed(code[at:]))
    head = "".join(s if s.endswith("\n") else s + "\n" for s in req.snippets)
    head += "\n" if head else ""
    return EditPlan(pieces, head=head + req.file_before, tail=req.file_after)


def clean_rewrite(text: str, after: str) -> str:
    """A rewritten line is followed by the rest of the region: no trailing newlines of its own there."""
    return text.rstrip("\n") if after.startswith("\n") or not after else text
