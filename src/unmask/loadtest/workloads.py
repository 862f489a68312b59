"""What a load test sends: a list of `Prompt`s from random text, a JSONL file, a ShareGPT file or the
project's held-out tasks. Each has either `text` (for /v1/completions) or `messages` (for
/v1/chat/completions); `as_messages` / `as_text` turn one into the other so any workload fits either route."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

WORDS = ("river stone light paper garden engine window silver morning cloud forest number music "
         "market letter bridge winter orange signal harbor").split()


class WorkloadError(ValueError):
    """Bad workload input: shown to the user as one line."""


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None  # from the file (ShareGPT's reference answer length) or the length spec

    def as_messages(self) -> list[dict]:
        return list(self.messages) if self.messages is not None else [{"role": "user", "content": self.text}]

    def as_text(self) -> str:
        if self.text is not None:
            return self.text
        return "\n".join(str(m.get("content") or "") for m in self.messages)


def parse_length(spec: str, flag: str) -> tuple[int, int]:
    """'N' -> (N, N); 'LO:HI' -> uniform over [LO, HI]; both >= 1."""
    try:
        lo, _, hi = spec.partition(":")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise WorkloadError(f"{flag} must be N or LO:HI (positive integers), got {spec!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise WorkloadError(f"{flag} must be N or LO:HI with 1 <= LO <= HI, got {spec!r}")
    return bounds


def random_prompts(n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[Prompt]:
    """Prompts of random words (about one token each on BPE tokenizers; the server's usage has the real count),
    an output budget drawn uniformly from output_len."""
    rng = random.Random(seed)
    return [Prompt(text=" ".join(rng.choices(WORDS, k=rng.randint(*input_len))), max_tokens=rng.randint(*output_len))
            for _ in range(n)]


def _lines(path: Path):
    if not path.is_file():
        raise WorkloadError(f"{path} not found")
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{path}:{i}: not JSON ({e.msg})") from None


def jsonl_prompts(path: Path) -> list[Prompt]:
    """One object a line: {"prompt": str} or {"messages": [{"role", "content"}, ...]}, optional "max_tokens"."""
    out = []
    for i, row in _lines(path):
        if not isinstance(row, dict):
            raise WorkloadError(f"{path}:{i}: expected an object with 'prompt' or 'messages'")
        mt = row.get("max_tokens")
        if mt is not None and (not isinstance(mt, int) or mt < 1):
            raise WorkloadError(f"{path}:{i}: max_tokens must be a positive integer")
        if isinstance(row.get("prompt"), str):
            out.append(Prompt(text=row["prompt"], max_tokens=mt))
        elif isinstance(row.get("messages"), list) and all(isinstance(m, dict) and "role" in m
                                                           for m in row["messages"]):
            out.append(Prompt(messages=tuple(row["messages"]), max_tokens=mt))
        else:
            raise WorkloadError(f"{path}:{i}: expected 'prompt' (a string) or 'messages' (a list of role/content)")
    if not out:
        raise WorkloadError(f"{path} has no prompts")
    return out


def sharegpt_prompts(path: Path, chars_per_token: float = 4.0) -> list[Prompt]:
    """ShareGPT format (a JSON list, or JSONL, of {"conversations": [{"from": "human"|"gpt", "value"}...]}):
    the first human turn is the prompt; the answer that follows sets max_tokens (its length in characters /
    chars_per_token, at least 1), as vLLM's sharegpt dataset uses the reference answer's length."""
    if not path.is_file():
        raise WorkloadError(f"{path} not found")
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError:
        rows = [row for _, row in _lines(path)]
    if not isinstance(rows, list):
        raise WorkloadError(f"{path}: expected a list of ShareGPT conversations")
    out = []
    for row in rows:
        conv = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict) and first.get("from") == "human"
                and isinstance(first.get("value"), str) and isinstance(second.get("value"), str)):
            continue
        out.append(Prompt(messages=({"role": "user", "content": first["value"]},),
                          max_tokens=max(1, round(len(second["value"]) / chars_per_token))))
    if not out:
        raise WorkloadError(f"{path} has no ShareGPT conversations (a human turn followed by an answer)")
    return out


def heldout_prompts(corpus_dir: Path, limit: int) -> list[Prompt]:
    """The held-out tasks of `unmask eval` (next-line and function-body prompts from the corpus's held-out
    files) as plain prompts, with their token budgets."""
    held = corpus_dir / "heldout.jsonl"
    if not held.is_file():
        raise WorkloadError(f"{held} not found: run `unmask corpus` first")
    from unmask.evaluation import FUNCTION_TOKENS, function_tasks, next_line_tasks
    from unmask.train.corpus import read_documents

    docs = list(read_documents(held))
    tasks = [(t, 16) for t in next_line_tasks(docs, limit)]
    tasks += [(t, FUNCTION_TOKENS) for t in function_tasks(docs, limit)]
    random.Random(0).shuffle(tasks)
    return [Prompt(text=t.prompt, max_tokens=n) for t, n in tasks[:limit]]


def cycle(prompts: list[Prompt], n: int, seed: int) -> list[Prompt]:
    """n prompts: the list shuffled (seeded) and repeated as needed."""
    order = prompts[:]
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(n)]


def budgets(prompts: list[Prompt], output_len: tuple[int, int], prefer_own: bool,
            seed: int) -> list[tuple[Prompt, int]]:
    """(prompt, max_tokens) pairs: the prompt's own budget where it has one and prefer_own, else drawn from
    output_len (seeded)."""
    rng = random.Random(seed)
    return [(p, p.max_tokens if prefer_own and p.max_tokens else rng.randint(*output_len)) for p in prompts]
