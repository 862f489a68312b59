"""The chunk index: one interface, two backends (sqlite_index.py, the embedded default; pg_index.py, Postgres
with pgvector), and the search modes on top of them.

A backend stores chunks (text plus a unit-length vector) by vector store and file, and answers two ranked
queries: keyword (BM25 on SQLite FTS5; `ts_rank_cd` on Postgres full-text) and vector (cosine similarity).
`search` runs one or both and, for `hybrid` (the default), fuses the two rankings by reciprocal rank:
score(chunk) = sum over rankings of 1 / (60 + rank), the k = 60 of Cormack, Clarke and Buettcher (SIGIR 2009).

Scores are in [0, 1] so that `ranking_options.score_threshold` means something in every mode: vector, the
cosine similarity (negative ones as 0); keyword, the backend's relevance r mapped to r / (1 + r); hybrid, the
fused score divided by its maximum 2 / 61 (a chunk first in both rankings scores 1).
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

RRF_K = 60
MODES = ("hybrid", "keyword", "vector")
CANDIDATES = 50   # per ranking before fusion (at least the results asked for)
WORD = re.compile(r"\w+")


@dataclass
class NewChunk:
    index: int
    text: str
    vector: np.ndarray   # unit length


@dataclass
class Hit:
    chunk_id: int
    store_id: str
    file_id: str
    chunk_index: int
    text: str
    score: float


def query_words(query: str) -> list[str]:
    """The words of a keyword query (each backend ORs them, so any word can match)."""
    return WORD.findall(query.lower())[:64]


class ChunkIndex(ABC):
    @abstractmethod
    def add(self, store_id: str, file_id: str, chunks: list[NewChunk]) -> None:
        """Insert a file's chunks in one transaction (a file's old chunks in that store are replaced)."""

    @abstractmethod
    def delete_file(self, file_id: str, store_id: str | None = None) -> int:
        """Remove a file's chunks from one store, or from every store; returns the count removed."""

    @abstractmethod
    def delete_store(self, store_id: str) -> None: ...

    @abstractmethod
    def count(self, store_id: str) -> int: ...

    @abstractmethod
    def keyword(self, store_ids: list[str], words: list[str], limit: int,
                file_ids: list[str] | None) -> list[tuple[int, float]]:
        """(chunk id, relevance >= 0), best first."""

    @abstractmethod
    def vector(self, store_ids: list[str], query: np.ndarray, limit: int,
               file_ids: list[str] | None) -> list[tuple[int, float]]:
        """(chunk id, cosine similarity), best first."""

    @abstractmethod
    def _chunk_rows(self, chunk_ids: list[int]) -> list[tuple]:
        """(id, store_id, file_id, chunk_index, text) of these chunks."""

    def fetch(self, chunk_ids: list[int]) -> dict[int, Hit]:
        """The chunks' rows (score 0) by id."""
        return {r[0]: Hit(r[0], r[1], r[2], r[3], r[4], 0.0) for r in self._chunk_rows(chunk_ids)} if chunk_ids else {}

    def close(self) -> None:
        pass

    def search(self, store_ids: list[str], query: str, query_vector: np.ndarray | None, limit: int,
               mode: str = "hybrid", file_ids: list[str] | None = None, score_threshold: float = 0.0) -> list[Hit]:
        """The best `limit` chunks of `store_ids` (of `file_ids` only, when given) for `query`."""
        if file_ids is not None and not file_ids:
            return []
        pool = max(limit, CANDIDATES) if mode == "hybrid" else limit
        ranked: dict[int, float] = {}
        if mode in ("hybrid", "keyword"):
            words = query_words(query)
            keyword = self.keyword(store_ids, words, pool, file_ids) if words else []
            if mode == "keyword":
                ranked = {cid: r / (1 + r) for cid, r in keyword}
        if mode in ("hybrid", "vector"):
            vector = self.vector(store_ids, query_vector, pool, file_ids)
            if mode == "vector":
                ranked = {cid: max(0.0, s) for cid, s in vector}
        if mode == "hybrid":
            ranked = fuse([keyword, vector])
        best = sorted(ranked.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        best = [(cid, s) for cid, s in best if s >= score_threshold]
        rows = self.fetch([cid for cid, _ in best])
        hits = []
        for cid, score in best:
            if cid in rows:   # a chunk deleted since it was ranked is left out
                rows[cid].score = float(score)
                hits.append(rows[cid])
        return hits


def fuse(rankings: list[list[tuple[int, float]]]) -> dict[int, float]:
    """Reciprocal rank fusion, scaled so that first place in every ranking scores 1."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, (cid, _) in enumerate(ranking, start=1):
            scores[cid] = scores.get(cid, 0.0) + 1.0 / (RRF_K + rank)
    top = len(rankings) / (RRF_K + 1)
    return {cid: s / top for cid, s in scores.items()}


def open_index(url: str | None, sqlite_path, dimension: int) -> ChunkIndex:
    """`--vector-store`: a postgresql:// URL, else the SQLite file `sqlite_path`."""
    if url and url.startswith(("postgresql://", "postgres://")):
        from unmask.retrieval.pg_index import PostgresIndex

        return PostgresIndex(url, dimension)
    from unmask.retrieval.sqlite_index import SQLiteIndex

    return SQLiteIndex(sqlite_path, dimension)
