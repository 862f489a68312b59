"""A second retrieval set for bench/retrieval.py (`--set code`): natural language to code, where a query and its
answer share few words. Every function or method of the held-out standard-library files
(data/corpus/heldout.jsonl, source `stdlib`) whose docstring's first line has at least four words and is unique is a
question: the query is that line, the answer the function's source with its docstring removed. The index holds
every documented function of the held-out and training standard-library files, docstrings removed (the
training ones are the distractors). Code written by the CPython developers, not here.
"""
from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

MIN_WORDS = 4


def functions(path: str, text: str) -> list[tuple[str, str, str]]:
    """(qualified name, docstring's first line, source without the docstring) of the documented functions."""
    try:
        tree = ast.parse(text)
    except SyntaxError:   # lib2to3's test data and the like
        return []
    lines = text.splitlines()
    out = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child)
                if doc and not isinstance(child, ast.ClassDef):
                    first = doc.strip().splitlines()[0].strip()
                    start = child.decorator_list[0].lineno if child.decorator_list else child.lineno
                    skip = range(child.body[0].lineno, child.body[0].end_lineno + 1)
                    body = "\n".join(lines[i - 1] for i in range(start, child.end_lineno + 1) if i not in skip)
                    out.append((name, first, body))
                visit(child, name + ".")

    visit(tree, "")
    return out


def load_code_set(root: Path) -> tuple[list[dict], list[dict]]:
    docs = []
    for split in ("heldout", "train"):
        for line in (root / "data" / "corpus" / f"{split}.jsonl").open():
            d = json.loads(line)
            if d["source"] == "stdlib":
                docs += [{"id": f"{d['path']}:{name}", "title": first, "body": body, "heldout": split == "heldout"}
                         for name, first, body in functions(d["path"], d["text"]) if body.strip()]
    counts = Counter(s["title"].lower() for s in docs)
    questions = [s for s in docs if s["heldout"] and len(s["title"].split()) >= MIN_WORDS
                 and counts[s["title"].lower()] == 1]
    return docs, questions
