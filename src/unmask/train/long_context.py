"""Long-context training data and RoPE scaling (issue 34, item 1).

Three pieces a continued-training run at growing lengths (2K -> 8K -> 32K) needs:

- `package_documents`: the corpus's files joined per package (a stdlib package, a docs directory) in path order,
  each file under a `# file: PATH` line, so one training row of several thousand tokens is one body of related
  code and text, not unrelated files cut at their separators. A package is the source plus the path's first
  directory (a top-level module file is its own package).
- `passkey_rows`: synthetic retrieval rows: training text with a `PASSKEY = "NNNNN"` line buried at a random
  depth and the row ending in the question `PASSKEY = "` and the value; only the value and its closing quote
  are loss-eligible, so a row teaches reading one fact back from far away (the task bench/needle.py scores, on
  training text instead of the held-out files; evaluation_needle.build_task makes both).
- `rope_scaling`: `--rope-scaling linear:4` / `yarn:4` as the public config.json form the loader parses
  (`{"rope_type": ..., "factor": ..., "original_max_position_embeddings": ...}`) and the context it gives;
  `apply_rope_scaling` writes it into a trainable model's config and rebuilds its rotary tables, so training
  and the exported config.json agree.
"""
from __future__ import annotations

import dataclasses
import random
from itertools import groupby
from typing import Callable, Iterable

import torch

from unmask.evaluation_needle import build_task
from unmask.train.corpus import CorpusFile
from unmask.train.data import DataError, TokenRows

SCALINGS = ("linear", "yarn")  # position interpolation and YaRN (arXiv 2309.00071), both in models/layers.py


def package_of(f: CorpusFile) -> str:
    """"stdlib/json" for stdlib/json/decoder.py; a file at the top of its source is its own package."""
    return f"{f.source}/{f.relpath.split('/', 1)[0]}"


def package_documents(files: Iterable[CorpusFile]) -> list[str]:
    """One text per package, its files in path order under `# file: PATH` lines."""
    ordered = sorted(files, key=lambda f: (package_of(f), f.relpath))
    return ["\n\n".join(f"# file: {f.relpath}\n{f.text}" for f in group)
            for _, group in groupby(ordered, key=package_of)]


def passkey_rows(encode: Callable[[str], list[int]], haystack: list[int], line_starts: set[int], seq_len: int,
                 n_rows: int, seed: int = 0) -> TokenRows:
    """`n_rows` rows of exactly `seq_len` tokens: haystack with a passkey line at a uniform random depth, then
    the question and the value; the loss mask covers the value and its closing quote only."""
    if len(haystack) < 2:
        raise DataError("passkey rows need a haystack of training text")
    rng = random.Random(seed)
    ids = torch.empty(n_rows, seq_len, dtype=torch.int32)
    mask = torch.zeros(n_rows, seq_len, dtype=torch.bool)
    for r in range(n_rows):
        value = f"{rng.randrange(10000, 100000)}"
        answer = encode(value + '"')
        try:
            task = build_task(encode, haystack, line_starts, seq_len - len(answer), rng.random(), value,
                              rng.randrange(len(haystack)))
        except ValueError as e:
            raise DataError(f"passkey rows: {e} (seq_len {seq_len})") from None
        ids[r] = torch.tensor(task.prompt_ids + answer, dtype=torch.int32)
        mask[r, seq_len - len(answer):] = True
    return TokenRows(ids, mask)


def rope_scaling(spec: str, original_max: int) -> tuple[dict, int]:
    """"linear:4" / "yarn:4" -> (config.json's rope_scaling, the context it gives: original_max x factor)."""
    kind, _, factor = spec.partition(":")
    try:
        f = float(factor)
    except ValueError:
        f = float("nan")
    if kind not in SCALINGS or not f > 1.0:
        raise DataError(f"--rope-scaling must be TYPE:FACTOR with TYPE one of {', '.join(SCALINGS)} and FACTOR > 1 "
                        f"(e.g. linear:4), got {spec!r}")
    scaling = {"rope_type": kind, "factor": f, "original_max_position_embeddings": int(original_max)}
    return scaling, int(original_max * f)


def apply_rope_scaling(tm, scaling: dict, max_position: int) -> None:
    """Write `scaling` into a TrainableModel's config (exported as config.json) and rebuild its rotary tables."""
    from unmask.models.layers import Rotary

    model = tm.model
    if not isinstance(getattr(model, "rope", None), Rotary) or not hasattr(model, "cfg"):
        raise DataError(f"--rope-scaling: the {tm.family.name} family's model has no rotary table to rescale")
    tm.config["rope_scaling"] = dict(scaling)
    tm.config["max_position_embeddings"] = max_position
    model.cfg = dataclasses.replace(model.cfg, rope_scaling=dict(scaling),
                                    max_position=tm.config["max_position_embeddings"])
    model.rope = Rotary(model.cfg.head_dim, model.cfg.rope_theta, model.rope.rotary_dim, scaling)
    tm.arch = model.cfg


def scale_rope(tm, spec: str, seq_len: int) -> None:
    """`--rope-scaling spec` on a TrainableModel, relative to the context it was trained for without scaling (a
    second stage's factor replaces the first's rather than multiplying it)."""
    prior = tm.config.get("rope_scaling") or {}
    original = int(prior.get("original_max_position_embeddings") or tm.config.get("max_position_embeddings")
                   or seq_len)
    apply_rope_scaling(tm, *rope_scaling(spec, original))


def long_context_rows(data, tokenizer, vocab_size: int, seq_len: int, sep_id: int, rows: TokenRows,
                      long_documents: bool, passkey_fraction: float, seed: int,
                      log: Callable[[str], None] = print) -> TokenRows:
    """The pre-training rows of `unmask train --long-documents / --passkey-fraction`: the corpus re-packed as one
    document per package (each followed by `sep_id`) instead of one per file, plus passkey rows (haystack: the
    training stream) making up `passkey_fraction` of the result. Text rows keep the loss on every token."""
    from unmask.evaluation_needle import line_starts
    from unmask.train.corpus import read_documents
    from unmask.train.data import corpus_files, pack_documents

    if long_documents:
        train, _ = corpus_files(data)
        if train.suffix != ".jsonl":
            raise DataError(f"--long-documents needs the corpus as JSONL documents, not {train.name}")
        docs = package_documents(read_documents(train))
        rows = pack_documents((tokenizer.encode(d, parse_special=False) for d in docs), seq_len, sep_id)
        log(f"long documents: {len(docs):,} packages, {len(rows):,} rows of {seq_len} tokens")
    if passkey_fraction <= 0:
        return rows
    n = round(len(rows) * passkey_fraction / (1.0 - passkey_fraction))
    haystack = rows.ids.flatten()[: 4 * seq_len * max(n, 1) + seq_len].tolist()  # plenty of distinct offsets
    keys = passkey_rows(tokenizer.encode, haystack, line_starts(tokenizer, vocab_size), seq_len, n, seed)
    log(f"passkey rows: {n:,} of {len(rows) + n:,} ({passkey_fraction:.0%})")
    text_mask = rows.loss_mask if rows.loss_mask is not None else torch.ones_like(rows.ids, dtype=torch.bool)
    return TokenRows(torch.cat([rows.ids, keys.ids.to(rows.ids.dtype)]), torch.cat([text_mask, keys.loss_mask]))
