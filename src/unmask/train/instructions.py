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
from typing import Any, Collection, Iterable, Iterator

from unmask.train.corpus import (HELDOUT_FRACTION, CorpusFile, atomic_open, heldout_score, is_heldout,
                                 read_jsonl_objects)

Record = dict[str, Any]


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


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


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
    return {"kind": "implement", "path": f.key, "messages": [_user(prompt), _assistant(answer)]}


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
        out.append({"kind": "explain", "path": f.key, "messages": [_user(q), _assistant(para)]})
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
                        "messages": [_user(q), _assistant(para)]})
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
            out.append({"kind": "explain", "path": f.key, "messages": [_user(q), _assistant(answer)]})
    return out


# ---------------------------------------------------------------- templated: tools and JSON
# Kept in this module on purpose (one data-building entry point); pools are small and fixed.

_CITIES = ["Paris", "Lyon", "Berlin", "Madrid", "Lisbon", "Rome", "Oslo", "Tokyo", "Osaka",
           "Seoul", "Nairobi", "Cairo", "Lagos", "Lima", "Quito", "Toronto", "Denver", "Boston",
           "Austin", "Sydney", "Perth", "Dublin", "Vienna", "Prague", "Warsaw", "Athens",
           "Istanbul", "Mumbai", "Delhi", "Hanoi", "Jakarta", "Manila", "Santiago", "Bogota",
           "Havana", "Reykjavik", "Helsinki", "Zurich", "Geneva", "Montreal"]
_TIMEZONES = ["Europe/Paris", "Europe/London", "America/New_York", "America/Chicago",
              "America/Los_Angeles", "Asia/Tokyo", "Asia/Kolkata", "Australia/Sydney", "UTC",
              "Africa/Nairobi", "America/Sao_Paulo", "Asia/Singapore"]
_CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR", "BRL", "SEK"]
_CONDITIONS = ["sunny", "cloudy", "rainy", "foggy", "windy", "snowy", "partly cloudy"]
_FIRST = ["Alice", "Bob", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal",
          "Keiko", "Liam", "Maria", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sven", "Tara",
          "Umar", "Vera", "Wei", "Yara", "Zoe"]
_LAST = ["Smith", "Garcia", "Martin", "Kowalski", "Nguyen", "Okafor", "Rossi", "Schmidt",
         "Tanaka", "Silva", "Dubois", "Novak", "Haddad", "Larsen", "Moreau", "Patel", "Kim"]
_JOBS = ["nurse", "teacher", "carpenter", "software engineer", "baker", "pilot", "chemist",
         "librarian", "plumber", "architect", "journalist", "farmer", "dentist", "translator"]
_ITEMS = ["notebook", "pencil", "mug", "lamp", "chair", "backpack", "keyboard", "umbrella",
          "towel", "candle", "plate", "bottle"]
_ADJ = ["Silent", "Hidden", "Last", "Broken", "Golden", "Distant", "Quiet", "Burning", "Lost"]
_NOUN = ["River", "Garden", "Harbor", "Mountain", "Letter", "Bridge", "Winter", "Orchard", "Clock"]
_EVENTS = ["PyCon meetup", "book fair", "jazz festival", "science fair", "charity run",
           "board game night", "film screening", "hackathon"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_TASKS = ["call the dentist", "water the plants", "submit the report", "buy milk",
          "back up my laptop", "renew my passport", "pay the electricity bill"]

_TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {"description": "Get the current weather for a city.", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}},
    "search_docs": {"description": "Search the Python documentation.", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"]}},
    "run_python": {"description": "Run a Python snippet and return its standard output.",
                   "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                  "required": ["code"]}},
    "get_time": {"description": "Get the current local time in an IANA time zone.",
                 "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                "required": ["timezone"]}},
    "convert_currency": {"description": "Convert an amount of money between currencies.",
                         "parameters": {"type": "object", "properties": {
                             "amount": {"type": "number"},
                             "from_currency": {"type": "string", "enum": _CURRENCIES},
                             "to_currency": {"type": "string", "enum": _CURRENCIES}},
                             "required": ["amount", "from_currency", "to_currency"]}},
    "create_reminder": {"description": "Create a reminder.", "parameters": {
        "type": "object", "properties": {
            "text": {"type": "string"},
            "time": {"type": "string", "description": "24h time, HH:MM"}},
        "required": ["text", "time"]}},
}


def tool_spec(name: str) -> dict[str, Any]:
    """OpenAI-style tool entry for one synthetic tool."""
    return {"type": "function", "function": {"name": name, **_TOOLS[name]}}


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class _Scenario:
    user: str
    calls: list[dict[str, Any]]
    results: list[Any]
    final: str


def _weather(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    cities = rng.sample(_CITIES, rng.choice([1, 1, 1, 2]))
    unit = rng.choice(["celsius", "celsius", "fahrenheit"])
    sym = "°C" if unit == "celsius" else "°F"
    calls, results, parts = [], [], []
    for city in cities:
        args = {"city": city} if unit == "celsius" else {"city": city, "unit": unit}
        temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(25, 95)
        cond = rng.choice(_CONDITIONS)
        calls.append(_call("get_weather", args))
        results.append({"city": city, "temperature": temp, "unit": unit, "condition": cond})
        parts.append(f"{city}: {temp}{sym}, {cond}")
    if len(cities) == 2:
        user = rng.choice(["Compare the weather in {a} and {b}.",
                           "What's the weather in {a} and in {b}?"]).format(a=cities[0], b=cities[1])
    else:
        user = rng.choice(["What's the weather like in {a}?", "Is it cold in {a} right now?",
                           "Weather in {a} please.", "How warm is it in {a} today?"]
                          ).format(a=cities[0])
    if unit == "fahrenheit":
        user = user.rstrip(".?") + " (in Fahrenheit)?"
    return _Scenario(user, calls, results, "Current weather: " + "; ".join(parts) + ".")


def _search(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    name, summary = rng.choice(facts) if facts else ("json", "JSON encoder and decoder.")
    k = rng.randint(1, 5)
    user = rng.choice(["Search the docs for `{n}`.", "Look up `{n}` in the Python documentation.",
                       "Can you find documentation about `{n}`?"]).format(n=name)
    args: dict[str, Any] = {"query": name} if rng.random() < 0.5 else {"query": name, "max_results": k}
    result = [{"title": name, "summary": summary}]
    return _Scenario(user, [_call("search_docs", args)], [result], f"`{name}`: {summary}")


def _python(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(0, 999)
        code, value = f"print({a} * {b} + {c})", str(a * b + c)
        user = f"Use Python to compute {a} * {b} + {c}."
    elif kind == 1:
        xs = [rng.randint(-50, 99) for _ in range(rng.randint(3, 8))]
        code, value = f"print(sorted({xs}))", str(sorted(xs))
        user = f"Sort {xs} with Python."
    else:
        word = rng.choice(_NOUN).lower() + rng.choice(_ITEMS)
        code, value = f"print(len({word!r}))", str(len(word))
        user = f"Run Python to count the characters in {word!r}."
    return _Scenario(user, [_call("run_python", {"code": code})], [{"stdout": value + "\n"}],
                     f"The output is {value}.")


def _time(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    tz = rng.choice(_TIMEZONES)
    hhmm = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    user = rng.choice(["What time is it in {t}?", "Current time in {t}?",
                       "Tell me the local time for {t}."]).format(t=tz)
    return _Scenario(user, [_call("get_time", {"timezone": tz})], [{"timezone": tz, "time": hhmm}],
                     f"It is {hhmm} in {tz}.")


def _currency(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    src, dst = rng.sample(_CURRENCIES, 2)
    amount = rng.choice([5, 10, 20, 50, 75, 100, 250, 1000, 12.5, 99.99])
    converted = round(amount * rng.uniform(0.5, 1.6), 2)
    user = rng.choice(["How much is {a} {s} in {d}?", "Convert {a} {s} to {d}.",
                       "I have {a} {s}. What is that in {d}?"]).format(a=amount, s=src, d=dst)
    args = {"amount": amount, "from_currency": src, "to_currency": dst}
    return _Scenario(user, [_call("convert_currency", args)],
                     [{"amount": converted, "currency": dst}],
                     f"{amount} {src} is about {converted} {dst}.")


def _reminder(rng: random.Random, facts: list[tuple[str, str]]) -> _Scenario:
    task, hhmm = rng.choice(_TASKS), f"{rng.randint(6, 22):02d}:{rng.choice(['00', '15', '30', '45'])}"
    user = rng.choice(["Remind me to {x} at {t}.", "Set a reminder at {t} to {x}."]).format(x=task, t=hhmm)
    return _Scenario(user, [_call("create_reminder", {"text": task, "time": hhmm})],
                     [{"status": "ok", "id": rng.randint(1, 9999)}],
                     f"Done. I will remind you to {task} at {hhmm}.")


_SCENARIOS = {"get_weather": _weather, "search_docs": _search, "run_python": _python,
              "get_time": _time, "convert_currency": _currency, "create_reminder": _reminder}


def tool_call_record(rng: random.Random, facts: list[tuple[str, str]]) -> Record:
    """One tool-use conversation: call only (55%), call + result + answer (35%), or no call."""
    mode = rng.random()
    if mode < 0.1 and facts:
        # Tools are offered but not needed: answer directly.
        name, summary = rng.choice(facts)
        tools = rng.sample([t for t in _TOOLS if t != "search_docs"], rng.randint(1, 3))
        messages = [_user(f"Without using any tool: what does `{name}` do?"), _assistant(summary)]
    else:
        tool = rng.choice(sorted(_SCENARIOS))
        s = _SCENARIOS[tool](rng, facts)
        # at most two other tools: with three, 18% of conversations outgrew 512-token rows
        others = rng.sample([t for t in _TOOLS if t != tool], rng.randint(0, 2))
        tools = others + [tool]
        rng.shuffle(tools)
        messages = [_user(s.user), {"role": "assistant", "content": "", "tool_calls": s.calls}]
        if mode >= 0.65:
            messages += [{"role": "tool", "name": c["function"]["name"],
                          "content": json.dumps(r, ensure_ascii=False)}
                         for c, r in zip(s.calls, s.results)]
            messages.append(_assistant(s.final))
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    return {"kind": "tool_call", "tools": [tool_spec(t) for t in tools], "messages": messages}


def _person(rng: random.Random) -> tuple[str, dict[str, Any]]:
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    age, job = rng.randint(19, 80), rng.choice(_JOBS)
    city = rng.choice(_CITIES) if rng.random() < 0.8 else None
    if city is None:
        text = rng.choice(["{n} is a {a}-year-old {j}.", "{n}, {a}, works as a {j}."])
    else:
        text = rng.choice(["{n} is a {a}-year-old {j} living in {c}.",
                           "Meet {n}: {a} years old, works as a {j} in {c}.",
                           "{n} moved to {c} last year; the {a}-year-old is a {j}."])
    return text.format(n=name, a=age, j=job, c=city), {"name": name, "age": age, "city": city,
                                                        "occupation": job}


def _order(rng: random.Random) -> tuple[str, dict[str, Any]]:
    item, qty = rng.choice(_ITEMS), rng.randint(1, 12)
    price, cur = round(rng.uniform(1, 80), 2), rng.choice(_CURRENCIES[:4])
    text = rng.choice(["I'd like to order {q} {i}s at {p} {c} each.",
                       "Please send {q} x {i} ({p} {c} per unit).",
                       "Order: {i}, quantity {q}, unit price {p} {c}."]).format(q=qty, i=item, p=price, c=cur)
    return text, {"item": item, "quantity": qty, "unit_price": price, "currency": cur}


def _event(rng: random.Random) -> tuple[str, dict[str, Any]]:
    title, city = rng.choice(_EVENTS), rng.choice(_CITIES)
    year, month, day = rng.randint(2020, 2030), rng.randint(1, 12), rng.randint(1, 28)
    text = rng.choice(["The {t} will take place in {c} on {m} {d}, {y}.",
                       "Join us on {m} {d}, {y} for the {t} in {c}!"]
                      ).format(t=title, c=city, m=_MONTHS[month - 1], d=day, y=year)
    return text, {"event": title, "city": city, "date": f"{year:04d}-{month:02d}-{day:02d}"}


def _book(rng: random.Random) -> tuple[str, dict[str, Any]]:
    title = f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)}"
    author, year = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", rng.randint(1850, 2024)
    text = rng.choice(["'{t}' was written by {a} and published in {y}.",
                       "{a} published {t} in {y}.", "In {y}, {a} released the novel \"{t}\"."]
                      ).format(t=title, a=author, y=year)
    return text, {"title": title, "author": author, "year": year}


_JSON_KINDS = [_person, _order, _event, _book]


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number"}.get(type(value), "string")


def json_record(rng: random.Random, facts: list[tuple[str, str]]) -> Record:
    """Extract fields from a sentence; the answer is exactly one JSON object."""
    text, obj = rng.choice(_JSON_KINDS)(rng)
    keys = list(obj)
    if rng.random() < 0.5:
        prompt = (f"Extract {', '.join(keys[:-1])} and {keys[-1]} from the text as a JSON object "
                  f"(use null for anything missing). Answer with JSON only.\n\nText: {text}")
    else:
        schema = {"type": "object", "required": keys, "properties": {
            k: {"type": [_json_type(v), "null"]} if v is None or k == "city" else {"type": _json_type(v)}
            for k, v in obj.items()}}
        if "date" in obj:
            schema["properties"]["date"]["format"] = "date"
        prompt = (f"Return a JSON object matching this schema:\n{json.dumps(schema)}\n\n"
                  f"Text: {text}")
    return {"kind": "json", "messages": [_user(prompt), _assistant(json.dumps(obj, ensure_ascii=False))]}


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
