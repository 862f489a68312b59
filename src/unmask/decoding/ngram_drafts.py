"""Drafts from a table of the training text's n-grams, for the `speculative` policy.

Retrieval-based speculative decoding (REST, He et al., NAACL 2024, arXiv 2311.08252; compacted to common short
n-grams in CREST, arXiv 2408.04678) drafts from a datastore of text rather than from a draft model: code and
prose repeat their idioms (`self.assertEqual(`, `def __init__(self,`, `if __name__ == "__main__":`), and a small
model's own answers repeat them even more. Here the datastore is a table:
for every context of 1 to `max_n` tokens seen in the training text, the token that most often followed it
(kept where it followed at least `min_count` times). A draft continues the text greedily, longest known context
first. Like prompt lookup it costs no model compute, only the verifier rows of what it drafts, and the verifier
decides the output, so the output is unchanged.

Contexts are packed into one int64 (`bits` per token, so max_n * bits <= 63) and kept sorted per n; a lookup is a
binary search. The table travels beside the weights as `ngram_drafts.safetensors` (`unmask ngram-drafts` builds it)
with the sha256 of the tokenizer it was counted with, so a table from another tokenizer is refused.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

FILE = "ngram_drafts.safetensors"
FORMAT = "unmask-ngram-drafts/1"


def token_bits(vocab_size: int) -> int:
    return max(1, (int(vocab_size) - 1).bit_length())


def longest_context(vocab_size: int, wanted: int = 4) -> int:
    """The longest context that packs into an int64 for this vocabulary (4 for 8,192 tokens, 3 for 151,936)."""
    return max(1, min(wanted, 63 // token_bits(vocab_size)))


def tokenizer_digest(tokenizer_file: Path) -> str:
    return hashlib.sha256(Path(tokenizer_file).read_bytes()).hexdigest()


@dataclass(frozen=True)
class NgramTable:
    vocab_size: int
    keys: tuple[np.ndarray, ...]    # keys[n - 1]: sorted packed contexts of n tokens
    nexts: tuple[np.ndarray, ...]   # the token that most often followed each
    tokenizer: str                  # sha256 of the tokenizer.json the text was counted with
    min_count: int
    source_tokens: int              # tokens counted (the text's, and the model's own continuations with the
                                    # last tokens of each prompt)
    own_tokens: int = 0             # tokens the model wrote for it (unmask ngram-drafts --own-prompts)

    @property
    def max_n(self) -> int:
        return len(self.keys)

    @property
    def bits(self) -> int:
        return token_bits(self.vocab_size)

    def __len__(self) -> int:
        return sum(len(k) for k in self.keys)

    def next_token(self, context: Sequence[int]) -> int | None:
        """The most frequent follower of the longest known suffix of `context` (None where no suffix is known)."""
        bits = self.bits
        for n in range(min(self.max_n, len(context)), 0, -1):
            code = 0
            for t in context[len(context) - n:]:
                code = (code << bits) | int(t)
            keys = self.keys[n - 1]
            i = int(np.searchsorted(keys, code))
            if i < len(keys) and int(keys[i]) == code:
                return int(self.nexts[n - 1][i])
        return None

    def draft(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts continuing `ids` (only its last max_n tokens are read); stops where no suffix
        of the text so far is in the table."""
        context = [int(t) for t in ids[max(0, len(ids) - self.max_n):]]
        out: list[int] = []
        while len(out) < max_tokens:
            t = self.next_token(context)
            if t is None:
                break
            out.append(t)
            context = context[1:] + [t] if len(context) == self.max_n else context + [t]
        return out


def count(documents: Iterable[Sequence[int]], vocab_size: int, tokenizer: str, max_n: int = 4,
          min_count: int = 4) -> NgramTable:
    """The table of `documents` (token ids each; n-grams never span two): per context length n = 1..max_n (at most
    what packs into an int64), each context's most frequent next token, kept where it occurred >= min_count
    times (ties: the smaller token id)."""
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    max_n = min(max_n, longest_context(vocab_size, max_n))
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    parts, doc_ids = [], []
    for d, doc in enumerate(documents):
        a = np.asarray(doc, dtype=np.int64)
        if a.size:
            parts.append(a)
            doc_ids.append(np.full(a.size, d, dtype=np.int64))
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    doc = np.concatenate(doc_ids) if doc_ids else np.zeros(0, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
    bits = token_bits(vocab_size)
    keys, nexts = [], []
    for n in range(1, max_n + 1):
        m = ids.size - n   # windows ids[i:i+n] followed by ids[i+n]
        if m <= 0:
            keys.append(np.zeros(0, np.int64))
            nexts.append(np.zeros(0, np.int32))
            continue
        code = np.zeros(m, dtype=np.int64)
        for j in range(n):
            code = (code << bits) | ids[j:j + m]
        follow = ids[n:]
        same_doc = doc[:m] == doc[n:]
        code, follow = code[same_doc], follow[same_doc]
        keys_n, nexts_n = _most_frequent(code, follow, min_count)
        keys.append(keys_n)
        nexts.append(nexts_n)
    return NgramTable(vocab_size, tuple(keys), tuple(nexts), tokenizer, min_count, int(ids.size))


def _most_frequent(code: np.ndarray, follow: np.ndarray, min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct code, its most frequent follower (count >= min_count), codes sorted."""
    if code.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    order = np.lexsort((follow, code))
    c, f = code[order], follow[order]
    new_pair = np.ones(c.size, bool)
    new_pair[1:] = (c[1:] != c[:-1]) | (f[1:] != f[:-1])
    starts = np.flatnonzero(new_pair)
    counts = np.diff(np.append(starts, c.size))
    pc, pf = c[starts], f[starts]
    new_code = np.ones(pc.size, bool)
    new_code[1:] = pc[1:] != pc[:-1]
    group = np.cumsum(new_code) - 1
    best = np.maximum.reduceat(counts, np.flatnonzero(new_code))
    winners = np.flatnonzero(counts == best[group])
    _, first = np.unique(group[winners], return_index=True)   # ties: the first, the smallest token id
    pick = winners[first]
    keep = counts[pick] >= min_count
    return pc[pick][keep], pf[pick][keep].astype(np.int32)


def save(table: NgramTable, path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for n, (k, x) in enumerate(zip(table.keys, table.nexts), start=1):
        tensors[f"keys.{n}"] = torch.from_numpy(np.ascontiguousarray(k, dtype=np.int64))
        tensors[f"next.{n}"] = torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32))
    meta = {"format": FORMAT, "vocab_size": str(table.vocab_size), "max_n": str(table.max_n),
            "min_count": str(table.min_count), "tokenizer_sha256": table.tokenizer,
            "source_tokens": str(table.source_tokens), "own_tokens": str(table.own_tokens)}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)   # safetensors writes 0600; the table is as public as the weights beside it
    tmp.replace(path)   # a reader never sees half a table
    return path


def counted_with(path: Path) -> str | None:
    """The tokenizer digest a table file records (None: not a table), read from its header alone."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - unreadable: not a table this code can use
        return None
    return meta.get("tokenizer_sha256") if meta.get("format") == FORMAT else None


class TableMismatch(ValueError):
    """A table that does not belong to the model it would draft for."""


def load(path: Path, vocab_size: int, tokenizer: str | None) -> NgramTable:
    """The table at `path`, checked against the model's vocabulary size and tokenizer digest (TableMismatch)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise TableMismatch(f"{path}: not an n-gram draft table (format {meta.get('format')!r}, "
                                    f"expected {FORMAT!r})")
            max_n = int(meta["max_n"])
            keys = tuple(f.get_tensor(f"keys.{n}") for n in range(1, max_n + 1))
            nexts = tuple(f.get_tensor(f"next.{n}") for n in range(1, max_n + 1))
    except TableMismatch:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: one line naming it
        raise TableMismatch(f"{path}: cannot read the n-gram draft table ({type(e).__name__}: {e})") from e
    if int(meta["vocab_size"]) != vocab_size:
        raise TableMismatch(f"{path} was counted for a vocabulary of {meta['vocab_size']} tokens, the model has "
                            f"{vocab_size}: rebuild it with `unmask ngram-drafts`")
    if tokenizer is not None and meta.get("tokenizer_sha256") != tokenizer:
        raise TableMismatch(f"{path} was counted with another tokenizer (sha256 "
                            f"{str(meta.get('tokenizer_sha256'))[:12]}, the model's {tokenizer[:12]}): rebuild it "
                            "with `unmask ngram-drafts`")
    return NgramTable(vocab_size, keys, nexts, meta.get("tokenizer_sha256", ""), int(meta["min_count"]),
                      int(meta["source_tokens"]), int(meta.get("own_tokens", 0)))
