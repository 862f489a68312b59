"""Needle in a haystack: can the model retrieve one fact placed at a chosen depth of a long prompt?

The haystack is real text: the corpus's held-out files (never seen in training) joined in order and tokenized,
read from a different offset for each trial (cycled when the lengths asked exceed it). The needle is one Python
line, `PASSKEY = "73914"` (a random 5-digit value per task), inserted at a line start nearest the asked depth
of the haystack (0 = the prompt's start, 1 = just before the question). The question repeats the needle's
line up to the value, `PASSKEY = "`, so the answer is an exact-prefix copy: the form of retrieval a small code
model trained on Python source has the best chance at (the built-in model's corpus is CPython's standard
library, its docs and torch's source; docs/model-card.md). The prompt is exactly `length` tokens:
haystack[:a] + needle + haystack[a:] + question. Scored by exact match of the value: the answer up to its
closing quote or newline.

Lengths past the model's configured context run with the engine's limit raised (`raise_context`), as the
cost benchmarks do: RoPE positions are computed on the fly, so the run is real, though a model trained on
shorter rows has no reason to succeed there; such rows are marked `past_context`.
"""
from __future__ import annotations

import dataclasses
import random
import re
import time
from dataclasses import dataclass
from typing import Callable

from unmask.engine.llm import LLM
from unmask.engine.params import DEFAULT_POLICY, GenerationParams
from unmask.errors import MemoryLimitError

KEY = "PASSKEY"
NEEDLE = '\n{key} = "{value}"'
QUESTION = '\n{key} = "'
SNAP_TOKENS = 64  # the needle moves to the nearest line start at most this far from the asked position
LENGTHS = (1024, 4096, 16384, 65536, 131072)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class NeedleTask:
    length: int               # prompt tokens asked (and given: len(prompt_ids) == length)
    depth: float              # 0..1 of the haystack
    value: str                # the passkey: the answer scored
    prompt_ids: list[int]
    needle_start: int         # token offset of the needle in the prompt (== offset in the haystack before it)
    needle_len: int
    haystack_len: int         # haystack tokens in the prompt


def answer_value(text: str) -> str:
    """The value a generated answer gives: up to the closing quote or the end of the line, stripped."""
    return re.split(r'["\n]', text, maxsplit=1)[0].strip()


def is_correct(task: NeedleTask, text: str) -> bool:
    return answer_value(text) == task.value


def line_starts(tokenizer, vocab_size: int) -> set[int]:
    """Token ids whose text starts a line (this tokenizer merges a newline with the next line's indentation)."""
    n = min(tokenizer.vocab_size, vocab_size)
    return {i for i, t in enumerate(tokenizer.token_texts(n)) if t.startswith("\n")}


def build_task(encode, haystack: list[int], starts: set[int], length: int, depth: float, value: str,
               offset: int = 0) -> NeedleTask:
    """A prompt of exactly `length` tokens with the needle at `depth` of the haystack, read from `offset`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"a depth is in [0, 1], got {depth}")
    needle, question = encode(NEEDLE.format(key=KEY, value=value)), encode(QUESTION.format(key=KEY))
    h = length - len(needle) - len(question)
    if h < 1:
        raise ValueError(f"a {length}-token prompt has no room for a haystack around the needle")
    hay = [haystack[(offset + i) % len(haystack)] for i in range(h)]
    at = round(depth * h)
    if 0 < at < h:  # a line start nearby, so the needle is a line of its own; else the exact position
        near = [i for i in range(max(1, at - SNAP_TOKENS), min(h, at + SNAP_TOKENS + 1)) if hay[i] in starts]
        if near:
            at = min(near, key=lambda i: abs(i - at))
    ids = hay[:at] + needle + hay[at:] + question
    return NeedleTask(length, depth, value, ids, at, len(needle), h)


def build_tasks(llm: LLM, docs, lengths, depths, trials: int = 1, seed: int = 0) -> list[NeedleTask]:
    """`trials` tasks per (length, depth): each a new value and haystack offset, drawn from `seed`."""
    text = "\n\n".join(d.text for d in docs)
    if not text:
        raise ValueError("the held-out documents hold no text")
    haystack = llm.encode(text)
    starts = line_starts(llm.tokenizer, llm.spec.arch.vocab_size)
    rng = random.Random(seed)
    tasks = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                value, offset = f"{rng.randrange(10000, 100000)}", rng.randrange(len(haystack))
                tasks.append(build_task(llm.encode, haystack, starts, length, depth, value, offset))
    return tasks


def raise_context(llm: LLM, total: int) -> None:
    """Let the engine take `total` tokens (prompt + answer), past the model's configured context if need be."""
    if total > llm.engine.traits.max_context:
        llm.engine.traits = dataclasses.replace(llm.engine.traits, max_context=total)


@dataclass
class NeedleResult:
    length: int
    depth: float
    n: int = 0
    correct: int = 0
    refused: int = 0           # prompts refused up front (their KV cache would not fit in memory)
    past_context: bool = False
    seconds: float = 0.0
    answers: list[str] = dataclasses.field(default_factory=list)
    values: list[str] = dataclasses.field(default_factory=list)  # the passkeys asked, in the answers' order

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.n, 1)


def run(llm: LLM, tasks: list[NeedleTask], policy: dict | None = None, max_tokens: int = 8,
        log: Callable[[str], None] | None = None) -> list[NeedleResult]:
    """Greedy answers to `tasks`, one batch per length; one result per (length, depth), in task order. `log`, if
    given, gets a line as each length starts and ends (a 128K batch runs for many minutes on a CPU)."""
    knobs = policy or {}
    results: dict[tuple[int, float], NeedleResult] = {}
    for length in dict.fromkeys(t.length for t in tasks):
        group = [t for t in tasks if t.length == length]
        raise_context(llm, length + max_tokens)
        past = length + max_tokens > llm.spec.max_context
        cache = llm.engine.prefix_cache
        if cache is not None:  # one haystack per trial: nothing to reuse, and a long one would evict the rest
            cache.clear()
        params = GenerationParams(max_tokens=max_tokens, **knobs)
        fits = []
        for t in group:
            r = results.setdefault((t.length, t.depth), NeedleResult(t.length, t.depth, past_context=past))
            r.n += 1
            try:
                llm.engine.check_request(t.prompt_ids, params)
                fits.append(t)
            except MemoryLimitError:
                r.refused += 1
        if log:
            log(f"needle {_k(length)}: {len(fits)} prompts ({len(group) - len(fits)} refused), started "
                f"{time.strftime('%H:%M:%S')}")
        t0 = time.perf_counter()
        outs = llm.generate([t.prompt_ids for t in fits], params) if fits else []
        seconds = time.perf_counter() - t0
        if log:
            right = sum(is_correct(t, o.text) for t, o in zip(fits, outs))
            log(f"needle {_k(length)}: {right} of {len(fits)} right in {seconds:.0f} s")
        for t, out in zip(fits, outs):
            r = results[(t.length, t.depth)]
            r.seconds += seconds / len(fits)
            r.answers.append(out.text)
            r.values.append(t.value)
            r.correct += is_correct(t, out.text)
    return list(results.values())


def table(results: list[NeedleResult]) -> str:
    """Accuracy by depth (rows) and length (columns), as plain text."""
    lengths = sorted({r.length for r in results})
    depths = sorted({r.depth for r in results})
    cell = {(r.length, r.depth): r for r in results}
    head = f"{'depth':>6} " + " ".join(f"{_k(n) + ('*' if cell[(n, depths[0])].past_context else ''):>8}"
                                      for n in lengths)
    rows = [head]
    for d in depths:
        cells = []
        for n in lengths:
            r = cell.get((n, d))
            cells.append(f"{'-' if r is None else ('refused' if r.refused == r.n else f'{r.accuracy:.0%}'):>8}")
        rows.append(f"{d:>6.0%} " + " ".join(cells))
    return "\n".join(rows)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def report(llm: LLM, docs, lengths, depths, trials: int = 2, policy: str = "threshold_0.9", seed: int = 0,
           log: Callable[[str], None] | None = None) -> dict:
    """Build, run and tabulate: the JSON `unmask eval --needle --json` writes and bench/needle.py plots."""
    from unmask.evaluation import POLICIES

    if policy != DEFAULT_POLICY and policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {DEFAULT_POLICY}, {', '.join(POLICIES)}")
    knobs = {} if policy == DEFAULT_POLICY else POLICIES[policy]   # "default": the model's own
    results = run(llm, build_tasks(llm, docs, lengths, depths, trials, seed), knobs, log=log)
    return {"model": str(llm.spec.path), "policy": policy, "trials": trials, "seed": seed,
            "configured_context": llm.spec.max_context, "needle": NEEDLE.format(key=KEY, value="NNNNN"),
            "results": [{**dataclasses.asdict(r), "accuracy": r.accuracy} for r in results],
            "table": table(results)}
