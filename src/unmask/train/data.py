"""Training rows: pack tokenized documents, iterate batches in a resumable order.

A pre-training set is one token stream (documents each followed by a separator) cut into
fixed-length rows; an SFT set is one row per record with a loss mask. `BatchIterator` walks an
endless stream of per-epoch permutations whose whole state is one integer, so a resumed run
sees exactly the batches the killed run would have seen.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from unmask.errors import UnmaskError
from unmask.train.corpus import read_jsonl_objects


class DataError(UnmaskError, ValueError):
    """Training data is missing, malformed or does not fit the configuration."""


@dataclass
class TokenRows:
    ids: Tensor                     # [N, L] integer token ids
    loss_mask: Tensor | None = None  # [N, L] bool; None = every position is loss-eligible

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]

    def batch(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        ids = self.ids[idx].long()
        lm = self.loss_mask[idx] if self.loss_mask is not None else torch.ones_like(ids, dtype=torch.bool)
        return ids, lm


def pack_stream(stream: np.ndarray | Tensor, seq_len: int) -> TokenRows:
    """Cut a 1-D token stream into [N, seq_len] rows; the incomplete tail is dropped."""
    t = torch.as_tensor(np.asarray(stream).astype(np.int32, copy=False))
    n = t.numel() // seq_len
    if n == 0:
        raise DataError(f"only {t.numel()} tokens of data: not one row of seq_len {seq_len}")
    return TokenRows(t[: n * seq_len].view(n, seq_len))


def pack_documents(docs: Iterable[Sequence[int]], seq_len: int, sep_id: int) -> TokenRows:
    """Concatenate documents, each followed by `sep_id`, and cut into rows."""
    return pack_stream(_join(docs, sep_id), seq_len)


def _join(docs: Iterable[Sequence[int]], sep_id: int) -> np.ndarray:
    parts = []
    for d in docs:
        parts.append(np.asarray(d, dtype=np.int32))
        parts.append(np.asarray([sep_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


class BatchIterator:
    """Endless, seeded stream of global batches of row indices.

    Row order is a fresh permutation each epoch; batches run across epoch ends, so any dataset
    size works with any batch size. `state_dict()` is the number of rows consumed.
    """

    def __init__(self, n_rows: int, batch_size: int, seed: int):
        if n_rows <= 0:
            raise DataError("the training set has no rows")
        self.n, self.batch_size, self.seed = n_rows, batch_size, seed
        self.pos = 0
        self._epoch, self._perm = -1, None

    def _perm_for(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> Tensor:
        out = torch.empty(self.batch_size, dtype=torch.long)
        for k in range(self.batch_size):
            epoch, off = divmod(self.pos + k, self.n)
            out[k] = self._perm_for(epoch)[off]
        self.pos += self.batch_size
        return out

    @property
    def epoch(self) -> float:
        return self.pos / self.n

    def state_dict(self) -> dict:
        return {"pos": self.pos, "n_rows": self.n, "batch_size": self.batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if (state["n_rows"], state["seed"]) != (self.n, self.seed):
            raise DataError(f"checkpoint was taken on {state['n_rows']} rows with seed {state['seed']}, "
                            f"this run has {self.n} rows with seed {self.seed}: the data changed")
        self.pos = int(state["pos"])


def eval_batches(n_rows: int, batch_size: int, max_batches: int) -> Iterator[Tensor]:
    """The first rows of the eval split in order, in full batches (at least one if any rows)."""
    count = max(1, min(max_batches, n_rows // batch_size)) if n_rows else 0
    for i in range(count):
        yield torch.arange(i * batch_size, (i + 1) * batch_size) % n_rows


# ------------------------------------------------------------------ pre-training corpora

def read_corpus_jsonl(path: Path) -> Iterator[str]:
    """Texts of a corpus JSONL file ({"source", "path", "text"} per line); a line that is not UTF-8 JSON or has
    no string "text" raises a DataError naming file and line."""
    for n, rec in read_jsonl_objects(path):
        if not isinstance(rec.get("text"), str):
            raise DataError(f"{path}:{n}: not a corpus record with a string 'text' field")
        yield rec["text"]


def tokenize_corpus(path: Path, encode_batch: Callable[[list[str]], list[list[int]]], sep_id: int,
                    cache_dir: Path, fingerprint: str, log: Callable[[str], None] = print) -> np.ndarray:
    """Token stream of a corpus JSONL file, cached as .npy keyed by file, tokenizer and separator."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{fingerprint}|{sep_id}".encode()).hexdigest()[:16]
    cached = cache_dir / f"{path.stem}-{key}.npy"
    if cached.is_file():
        return np.load(cached, mmap_mode="r")
    t0 = time.perf_counter()
    docs: list[list[int]] = []
    texts = list(read_corpus_jsonl(path))
    for i in range(0, len(texts), 256):
        docs.extend(encode_batch(texts[i:i + 256]))
    stream = _join(docs, sep_id)
    stream = stream.astype(np.uint16 if stream.size == 0 or stream.max() < 65536 else np.int32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, stream)
    os.replace(tmp, cached)
    log(f"tokenized {path.name}: {len(docs):,} documents, {stream.size:,} tokens ({time.perf_counter() - t0:.1f} s)")
    return stream


def corpus_files(data: Path) -> tuple[Path, Path | None]:
    """(train, eval or None) from a corpus directory, a .jsonl file or a .npy token stream."""
    if data.is_dir():
        for ext in (".jsonl", ".npy"):
            train = data / f"train{ext}"
            if train.is_file():
                held = data / f"heldout{ext}"
                return train, held if held.is_file() else None
        raise DataError(f"{data} has neither train.jsonl nor train.npy")
    if data.is_file() and data.suffix in (".jsonl", ".npy"):
        return data, None
    raise DataError(f"training data {str(data)!r} not found (want a corpus directory, a .jsonl or a .npy file)")


def load_pretraining(data: Path, tokenizer, seq_len: int, sep_id: int, cache_dir: Path,
                     log: Callable[[str], None] = print) -> tuple[TokenRows, TokenRows | None]:
    """(train rows, eval rows or None) from `corpus_files(data)`; JSONL is tokenized once and cached."""
    train, held = corpus_files(data)
    tok_file = Path(getattr(tokenizer.hf, "name_or_path", "")) / "tokenizer.json"
    fingerprint = hashlib.sha256(tok_file.read_bytes()).hexdigest() if tok_file.is_file() else str(len(tokenizer.hf))

    def encode_batch(texts: list[str]) -> list[list[int]]:
        fast = getattr(tokenizer.hf, "backend_tokenizer", None)  # Rust, parallel, no length warnings
        if fast is not None:
            return [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)]
        return tokenizer.hf(texts, add_special_tokens=False)["input_ids"]

    def stream(path: Path) -> np.ndarray:
        if path.suffix == ".npy":
            return np.load(path, mmap_mode="r")
        return tokenize_corpus(path, encode_batch, sep_id, cache_dir, fingerprint, log)

    rows = pack_stream(stream(train), seq_len)
    eval_rows = None
    if held is not None:
        s = stream(held)
        eval_rows = pack_stream(s, seq_len) if len(s) >= seq_len else None
    return rows, eval_rows


def mix_rows(sft: TokenRows, text: TokenRows, fraction: float, seed: int) -> TokenRows:
    """SFT rows plus enough plain-text rows (drawn without replacement, seeded) that they make up
    `fraction` of the result; text rows keep their own loss mask (passkey rows: the value only), else are
    loss-eligible everywhere. Capped by the text available."""
    want = round(len(sft) * fraction / (1.0 - fraction))
    take = torch.randperm(len(text), generator=torch.Generator().manual_seed(seed))[: min(want, len(text))]
    ids = torch.cat([sft.ids, text.ids[take].to(sft.ids.dtype)])
    sft_mask = sft.loss_mask if sft.loss_mask is not None else torch.ones_like(sft.ids, dtype=torch.bool)
    text_mask = text.loss_mask[take] if text.loss_mask is not None else torch.ones(len(take), text.seq_len,
                                                                                   dtype=torch.bool)
    return TokenRows(ids, torch.cat([sft_mask, text_mask]))


def check_same_tokenizer(tok, tokenizer_dir: Path, model_dir: Path) -> None:
    """Continuing a model on text tokenized by another tokenizer trains it on the wrong ids. BPE training
    is reproducible for one `tokenizers` release, but releases can number equal-count merges differently,
    so a rebuilt data/tokenizer is not necessarily the one a model was trained with."""
    if not (model_dir / "tokenizer.json").is_file() or tokenizer_dir.resolve() == model_dir.resolve():
        return
    from unmask.tokenizer import Tokenizer

    if tok.hf.get_vocab() != Tokenizer(model_dir).hf.get_vocab():
        raise DataError(f"tokenizer {tokenizer_dir} numbers tokens differently from the one in {model_dir}; "
                        f"continue with the model's own (--tokenizer {model_dir})")


def check_vocab(tm, rows: TokenRows) -> None:
    top = int(rows.ids.max())
    if top >= tm.arch.vocab_size:
        raise DataError(f"token id {top} in the data is outside the model's vocabulary ({tm.arch.vocab_size})")
