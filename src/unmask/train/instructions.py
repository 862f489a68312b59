"""Offline instruction (chat SFT) and fill-in-the-middle data for unmask-tiny.

Record kinds (one JSON object per JSONL line; trainers read ``messages``/``tools`` or ``fim``
and may ignore the bookkeeping keys ``kind`` and ``path``):
  implement  signature + docstring of a stdlib function -> its implementation (``ast``)
  explain    "What does `module.name` do?" -> first paragraph of its docstring or reST docs
  fim        {"fim": {"prefix", "suffix", "middle"}} from stdlib code, line and block spans
  tool_call  templated calls to synthetic tools (``tools`` + assistant ``tool_calls``),
             some with a tool response and a final answer, some needing no call
  json       extract fields from a sentence into a JSON object

File-derived records come only from the files passed in, so building from the held-in files
and from the held-out files gives disjoint sets. Templated records (tool_call, json) have no
file; they are assigned to a split by a hash of their user prompt, so no prompt is in both.
Everything is a pure function of (files, seed).
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterable, Iterator

from unmask.train.corpus import (HELDOUT_FRACTION, CorpusFile, atomic_open, heldout_score, is_heldout,
                                 read_jsonl_objects)
# tool_call and json records (no corpus file) are built there; Record and the chat turns are shared
from unmask.train.instruction_templates import Record, assistant_turn, json_record, tool_call_record, user_turn


@dataclass(frozen=True)
class InstructionConfig:
    min_impl_lines: int = 3
    max_impl_lines: int = 40
    fim_line_per_file: int = 3  # single-line spans per code file
    fim_block_per_file: int = 3  # multi-line (whole statement) spans per code file
    # prefix and suffix are each cut to about this, at lines: 600 chars of stdlib code is ~170 tokens a side,
    # so a record fits the 512-token SFT rows (at 1,500, 72% of FIM records were longer and dropped)
    fim_context_chars: int = 600
    tool_calls_per_file: float = 1.5  # templated records scale with the number of files
    json_per_file: float = 1.0
    heldout_fraction: float = HELDOUT_FRACTION


def module_name(relpath: str) -> str:
    """'json/decoder.py' -> 'json.decoder', 'json/__init__.py' -> 'json'."""
    parts = relpath.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_public(dotted: str) -> bool:
    return not any(p.startswith("_") for p in dotted.split("."))


def first_paragraph(doc: str) -> str | None:
    """First prose paragraph of a docstring, reflowed to one line; None if unusable."""
    paras = [p for p in re.split(r"\n\s*\n", inspect.cleandoc(doc).strip()) if p.strip()]
    # C-style docstrings open with a signature line, e.g. "dumps(obj) -> str".
    if paras and re.match(r"^[\w.]+\(.*\)( -> .*)?$", paras[0].splitlines()[0]) and len(paras) > 1:
        paras = paras[1:]
    if not paras or ">>>" in paras[0]:
        return None
    text = " ".join(line.strip() for line in paras[0].splitlines())
    return text if _usable(text) else None


def _usable(text: str) -> bool:
    # A paragraph ending in ":" introduces a list or example that we cut off.
    return 15 <= len(text) <= 800 and not text.endswith(":")


# ---------------------------------------------------------------- stdlib code: implement/explain

def _definitions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(qualname, node) for top-level functions/classes and methods of top-level classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            yield node.name, node
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{sub.name}", sub


_IMPLEMENT_PROMPTS = [
    "Implement `{qual}` from Python's `{module}` module.\n\n```python\n{stub}\n```",
    "Complete this Python function so that it does what its docstring says.\n\n```python\n{stub}\n```",
    "Write the body of `{qual}` (module `{module}`):\n\n```python\n{stub}\n```",
]
_EXPLAIN_PROMPTS = ["What does `{name}` do?", "What does `{name}` do?",
                    "Briefly explain `{name}`.", "In Python, what is `{name}` for?"]
_MODULE_PROMPTS = ["What is the `{name}` module for?", "What does the `{name}` module do?"]


def _implement_record(f: CorpusFile, lines: list[str], qual: str, node: ast.AST,
                      rng: random.Random, cfg: InstructionConfig) -> Record | None:
    body = node.body
    if len(body) < 2 or ast.get_docstring(node) is None:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    n_lines = node.end_lineno - start + 1
    if not cfg.min_impl_lines <= n_lines <= cfg.max_impl_lines:
        return None
    src = lines[start - 1:node.end_lineno]
    indent = src[0][:len(src[0]) - len(src[0].lstrip())]
    # Strip exactly the def's indent; a line with less (e.g. inside a string) makes dedent lie.
    if any(line.strip() and not line.startswith(indent) for line in src):
        return None
    src = [line[len(indent):] for line in src]
    stub = "\n".join(src[:body[0].end_lineno - start + 1])
    module = module_name(f.relpath)
    prompt = rng.choice(_IMPLEMENT_PROMPTS).format(qual=qual, module=module, stub=stub)
    answer = "```python\n" + "\n".join(src) + "\n```"
    return {"kind": "implement", "path": f.key, "messages": [user_turn(prompt), assistant_turn(answer)]}


def _code_records(f: CorpusFile, rng: random.Random, cfg: InstructionConfig) -> list[Record]:
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError):
        return []
    lines = f.text.split("\n")
    module = module_name(f.relpath)
    out: list[Record] = []
    mod_doc = ast.get_docstring(tree)
    if mod_doc and _is_public(module) and (para := first_paragraph(mod_doc)):
        q = rng.choice(_MODULE_PROMPTS).format(name=module)
        out.append({"kind": "explain", "path": f.key, "messages": [user_turn(q), assistant_turn(para)]})
    for qual, node in _definitions(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            rec = _implement_record(f, lines, qual, node, rng, cfg)
            if rec:
                out.append(rec)
        doc = ast.get_docstring(node)
        name = f"{module}.{qual}"
        if doc and _is_public(name) and (para := first_paragraph(doc)):
            q = rng.choice(_EXPLAIN_PROMPTS).format(name=name)
            out.append({"kind": "explain", "path": f.key,
                        "messages": [user_turn(q), assistant_turn(para)]})
    out += _fim_records(f, tree, rng, cfg)
    return out


# ---------------------------------------------------------------- FIM

def _fim_records(f: CorpusFile, tree: ast.Module, rng: random.Random,
                 cfg: InstructionConfig) -> list[Record]:
    text = f.text
    lines = text.split("\n")  # ast counts lines on "\n" only (str.splitlines also splits \f)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line) + 1)
    stmts = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]
    singles = sorted({n.lineno for n in stmts
                      if n.lineno == n.end_lineno and len(lines[n.lineno - 1].strip()) >= 8})
    blocks = sorted({(n.lineno, n.end_lineno) for n in stmts if 2 <= n.end_lineno - n.lineno + 1 <= 15})
    spans: list[tuple[str, int, int]] = []
    for lineno in rng.sample(singles, min(cfg.fim_line_per_file, len(singles))):
        line = lines[lineno - 1]
        start = offsets[lineno - 1] + len(line) - len(line.lstrip())
        end = offsets[lineno - 1] + len(line.rstrip())
        # Half the time keep the head of the line (e.g. "x = ") and ask only for the tail.
        cut = re.search(r"(?<![=!<>])=(?!=)\s*|\breturn\s+|\(\s*", line.strip())
        if cut and cut.end() < len(line.strip()) and rng.random() < 0.5:
            start += cut.end()
        spans.append(("line", start, end))
    for first, last in rng.sample(blocks, min(cfg.fim_block_per_file, len(blocks))):
        spans.append(("block", offsets[first - 1], offsets[last]))  # whole lines incl. "\n"
    out = []
    for span, start, end in spans:
        if start >= end or end > len(text):
            continue
        lo = text.rfind("\n", 0, max(0, start - cfg.fim_context_chars)) + 1
        hi = text.find("\n", end + cfg.fim_context_chars)
        hi = len(text) if hi < 0 else hi + 1
        out.append({"kind": "fim", "path": f.key, "span": span,
                    "fim": {"prefix": text[lo:start], "suffix": text[end:hi],
                            "middle": text[start:end]}})
    return out


def format_fim(record: Record) -> str:
    """PSM layout for training text: <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>M."""
    fim = record["fim"]
    return (f"<|fim_prefix|>{fim['prefix']}<|fim_suffix|>{fim['suffix']}"
            f"<|fim_middle|>{fim['middle']}")


# ---------------------------------------------------------------- reST docs: explain

_DIRECTIVE = re.compile(r"^(\s*)\.\. (function|method|classmethod|staticmethod|class|exception|"
                        r"decorator|coroutinefunction|coroutinemethod)::\s*([\w.]+)")
_MODULE = re.compile(r"^\.\. (?:module|currentmodule):: *([\w.]+)")


def clean_rst(text: str) -> str:
    """Inline reST markup to plain text with `code` spans."""
    text = re.sub(r":(?:pep|PEP):`(\d+)[^`]*`", r"PEP \1", text)
    text = re.sub(r":rfc:`(\d+)[^`]*`", r"RFC \1", text)
    text = re.sub(r":(?:ref|term|doc|dfn|abbr|guilabel|menuselection|file|program|envvar):"
                  r"`([^`<]*?)\s*(?:<[^>]*>)?`", r"\1", text)

    def role(m: re.Match[str]) -> str:
        target = m.group(1).strip()
        if target.startswith("~"):
            target = target[1:].split(".")[-1]
        return f"`{target.lstrip('!')}`"

    text = re.sub(r":[\w:.-]+:`([^`<]*?)\s*(?:<[^>]*>)?`", role, text)
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`__?", r"\1", text)  # hyperlinks
    text = re.sub(r"\\(.)", r"\1", text).replace("|nbsp|", " ")
    return re.sub(r"\s+", " ", text).strip()


def _doc_records(f: CorpusFile, rng: random.Random) -> list[Record]:
    if not f.relpath.startswith("library/"):
        return []
    lines = f.text.split("\n")
    module: str | None = None
    cls: tuple[int, str] | None = None  # (indent, name) of the enclosing class directive
    out: list[Record] = []
    for i, line in enumerate(lines):
        if m := _MODULE.match(line):
            module, cls = m.group(1), None
            continue
        m = _DIRECTIVE.match(line)
        if not m:
            continue
        indent, kind, name = len(m.group(1)), m.group(2), m.group(3)
        if cls and indent > cls[0] and "." not in name:
            name = f"{cls[1]}.{name}"
        if kind in ("class", "exception"):
            cls = (indent, name)
        elif cls and indent <= cls[0]:
            cls = None
        full = name if not module or name.startswith(module + ".") else f"{module}.{name}"
        if "." in name and module and name.split(".")[0] in ("str", "bytes", "int", "float",
                                                              "list", "dict", "set", "object"):
            full = name  # builtins documented outside their module, e.g. str.join
        j = i + 1
        while j < len(lines) and lines[j].strip():  # continued signatures and :options:
            j += 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        para = []
        while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
            para.append(lines[j].strip())
            j += 1
        if not para or para[0].startswith(".."):
            continue
        answer = clean_rst(" ".join(para))
        if _usable(answer) and _is_public(full):
            q = rng.choice(_EXPLAIN_PROMPTS).format(name=full)
            out.append({"kind": "explain", "path": f.key, "messages": [user_turn(q), assistant_turn(answer)]})
    return out


# ---------------------------------------------------------------- assembly

def _file_rng(seed: int, f: CorpusFile) -> random.Random:
    # Per-file stream: a file's records do not change when other files come or go.
    return random.Random(f"{seed}:{f.key}")


def _templated(kind: str, count: int, seed: int, heldout: bool, facts: list[tuple[str, str]],
               cfg: InstructionConfig) -> list[Record]:
    """`count` unique records whose user-prompt hash falls in this split's bucket."""
    rng = random.Random(f"{seed}:{kind}")
    make = tool_call_record if kind == "tool_call" else json_record
    seen: set[str] = set()
    out: list[Record] = []
    tries = 0
    while len(out) < count and tries < 200 * count + 1000:
        tries += 1
        rec = make(rng, facts)
        prompt = first_user_prompt(rec) or ""
        key = hashlib.sha256(prompt.encode("utf-8")).hexdigest()
        if key in seen or (heldout_score(prompt) < cfg.heldout_fraction) != heldout:
            continue
        seen.add(key)
        out.append(rec)
    return out


def first_user_prompt(record: Record) -> str | None:
    return next((m["content"] for m in record.get("messages", []) if m["role"] == "user"), None)


def build_instructions(files: list[CorpusFile], seed: int, *, heldout: bool | None = None,
                       config: InstructionConfig | None = None,
                       exclude_prompts: Collection[str] = ()) -> list[Record]:
    """All records for these files, shuffled with `seed`.

    `heldout` picks the bucket for templated records; by default it is True exactly when every
    file is a held-out file (pass it explicitly for arbitrary subsets). `exclude_prompts` drops
    chat records whose first user prompt is listed: pass the train set's prompts when building
    the held-out set, because one API can be described by a held-in reST page and a held-out
    module (e.g. library/xml.sax.reader.rst and xml/sax/xmlreader.py).
    """
    cfg = config or InstructionConfig()
    if heldout is None:
        heldout = bool(files) and all(is_heldout(f, cfg.heldout_fraction) for f in files)
    records: list[Record] = []
    for f in sorted(files, key=lambda f: f.key):
        rng = _file_rng(seed, f)
        if f.source == "stdlib":
            records += _code_records(f, rng, cfg)
        elif f.source == "docs":
            records += _doc_records(f, rng)
    # Facts (name, one-line description) let tool examples answer from this split's own files.
    facts = [(r["messages"][0]["content"].split("`")[1], r["messages"][1]["content"])
             for r in records if r["kind"] == "explain"]
    n_tool = round(cfg.tool_calls_per_file * len(files))
    n_json = round(cfg.json_per_file * len(files))
    records += _templated("tool_call", n_tool, seed, heldout, facts, cfg)
    records += _templated("json", n_json, seed, heldout, facts, cfg)
    if exclude_prompts:
        records = [r for r in records
                   if (q := first_user_prompt(r)) is None or q not in exclude_prompts]
    random.Random(seed).shuffle(records)
    return records


def write_jsonl(records: Iterable[Record], path: Path | str) -> int:
    """Write one JSON object per line, atomically (see corpus.atomic_open); returns the number of records."""
    n = 0
    with atomic_open(path) as fh:
        for rec in records:
            fh.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
            n += 1
    return n


def read_jsonl(path: Path | str) -> Iterator[Record]:
    """Records of a JSONL file; a line that is not UTF-8 JSON of an object raises a DataError naming it."""
    for _, rec in read_jsonl_objects(path):
        yield rec


def count_kinds(records: Iterable[Record]) -> dict[str, int]:
    return dict(sorted(Counter(r["kind"] for r in records).items()))
