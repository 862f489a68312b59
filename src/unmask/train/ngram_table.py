"""`unmask ngram-drafts`: count a model's training text into its n-gram draft table (decoding.ngram_drafts), and
optionally the model's own greedy continuations of prompts cut from that text.

Why the model's own text: the verifier keeps a draft only where it is what the model itself would write, and a
model's greedy output is not the text's most common continuation (a small model repeats its favourite idioms).
Counting its continuations of training prompts beside the text drafts what it writes (SuffixDecoding, arXiv
2411.04975, drafts from a model's previous outputs for the same reason; here they are made once, offline). The
prompts come from the training text only, never held-out text. Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import re
import time
from pathlib import Path

from unmask.decoding import ngram_drafts
from unmask.errors import ModelLoadError
from unmask.train.data import DataError


def text_documents(path: Path):
    """The `text` of each JSONL object in `path` (a corpus directory: its train.jsonl), one document each."""
    from unmask.train.corpus import corpus_file, read_jsonl_objects

    file = corpus_file(path)
    for n, row in read_jsonl_objects(file):
        if not isinstance(row.get("text"), str):
            raise DataError(f"{file}:{n}: no string 'text'")
        yield row["text"]


CHUNK = 256   # prompts handed to the engine at once: its batch (64) stays full, memory stays bounded


class _Progress:
    """A rich progress bar over prompts continued (nothing when total is 0)."""

    def __init__(self, total: int):
        self.total, self.bar = total, None

    def __enter__(self):
        if self.total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("the model's own continuations"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), transient=True)
            self.task = self.bar.add_task("own", total=self.total)
            self.bar.start()
        return self

    def advance(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def line_prompts(texts: list[str], n: int, seed: int = 0, context_chars: int = 1200) -> list[str]:
    """`n` prompts cut from `texts` as the held-out next-line tasks are cut (evaluation.next_line_tasks): up to
    `context_chars` characters ending just before a newline, drawn at random (seeded) over documents and lines."""
    rng = random.Random(seed)
    starts = []
    for d, t in enumerate(texts):
        first = len(t) - len(t.lstrip())   # a prompt holds some text: newlines after the first non-blank one
        ends = [m.start() for m in re.finditer("\n", t) if m.start() > first]
        if ends:
            starts.append((d, ends))
    if n and not starts:
        raise DataError("the text has no line to cut a prompt before (--own-prompts needs multi-line documents)")
    prompts = []
    for _ in range(n):
        d, ends = rng.choice(starts)
        end = rng.choice(ends)
        prompts.append(texts[d][max(0, end - context_chars):end])
    return prompts


def own_continuations(model: Path, prompts: list[str], max_tokens: int, keep_context: int, dtype: str | None = None,
                      progress: bool = False) -> tuple[list[list[int]], int]:
    """The model's greedy continuations of `prompts` under its default policy (the engine, batched), each after the
    last `keep_context` prompt tokens so the table learns what follows the prompt's end too; and how many tokens
    the model wrote. The checkpoint's current table is not read: it may be the stale one being replaced."""
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams

    llm = LLM(model, dtype=dtype, ngram_drafts=False)
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0)
    outs = []
    with _Progress(len(prompts) if progress else 0) as bar:
        for i in range(0, len(prompts), CHUNK):   # every request at once held 14 GB for 8,192 prompts of a 5M model
            outs += llm.generate(prompts[i:i + CHUNK], params)
            bar.advance(len(outs))
    docs = [list(o.prompt_ids[max(0, len(o.prompt_ids) - keep_context):]) + list(o.token_ids) for o in outs]
    return docs, sum(len(o.token_ids) for o in outs)


def build_table(model: Path, text: Path, max_n: int = 4, min_count: int = 4,
                out: Path | None = None, own_prompts: int = 0, own_tokens: int = 64, seed: int = 0,
                dtype: str | None = None, progress: bool = False) -> tuple[Path, ngram_drafts.NgramTable, float]:
    """Count `text` with the model's tokenizer, and with `own_prompts` the model's own continuations of that many
    prompts cut from it (counted alongside, one document each), and write the table (default: beside the
    weights). Returns (the file, the table, seconds)."""
    from unmask.models.loader import load_spec
    from unmask.tokenizer import Tokenizer

    spec = load_spec(model)
    tok_file = spec.path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(f"{spec.path} has no tokenizer.json: the table records which tokenizer counted it")
    tokenizer = Tokenizer(spec.path)
    t0 = time.perf_counter()
    own, written = [], 0
    if own_prompts:   # the model writes first: the text's token lists are then counted as they are encoded
        keep = ngram_drafts.longest_context(spec.arch.vocab_size, max_n)
        prompts = line_prompts(list(text_documents(text)), own_prompts, seed)
        own, written = own_continuations(spec.path, prompts, own_tokens, keep, dtype, progress)
    docs = itertools.chain((tokenizer.encode(t) for t in text_documents(text)), own)
    table = ngram_drafts.count(docs, spec.arch.vocab_size, ngram_drafts.tokenizer_digest(tok_file), max_n,
                               min_count)
    table = dataclasses.replace(table, own_tokens=written)
    path = ngram_drafts.save(table, out or spec.path / ngram_drafts.FILE)
    return path, table, time.perf_counter() - t0
