"""`unmask ngram-drafts`: count a model's training text into its n-gram draft table (decoding.ngram_drafts)."""
from __future__ import annotations

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


def build_table(model: Path, text: Path, max_n: int = 4, min_count: int = 4,
                out: Path | None = None) -> tuple[Path, ngram_drafts.NgramTable, float]:
    """Count `text` with the model's tokenizer and write the table (default: beside the weights). Returns (the
    file, the table, seconds)."""
    from unmask.models.loader import load_spec
    from unmask.tokenizer import Tokenizer

    spec = load_spec(model)
    tok_file = spec.path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(f"{spec.path} has no tokenizer.json: the table records which tokenizer counted it")
    tokenizer = Tokenizer(spec.path)
    t0 = time.perf_counter()
    docs = (tokenizer.encode(t) for t in text_documents(text))
    table = ngram_drafts.count(docs, spec.arch.vocab_size, ngram_drafts.tokenizer_digest(tok_file), max_n,
                               min_count)
    path = ngram_drafts.save(table, out or spec.path / ngram_drafts.FILE)
    return path, table, time.perf_counter() - t0
