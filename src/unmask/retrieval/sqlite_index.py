"""The embedded chunk index: one SQLite file, FTS5 for keywords, vectors as float32 blobs scored with numpy.

Keyword relevance is FTS5's `bm25()` (negated: FTS5 returns lower-is-better), over the query's words ORed, with
the porter stemmer. Vectors are scanned exactly: a store's matrix is read once into memory and kept while the
store changes only through this object (one server process owns the file): adding a file updates the cached
matrix in place (the file's old rows out, its new ones in) rather than dropping it, since re-reading 100K
vectors took seconds; a deletion drops it. A search is one matrix-vector product. sqlite-vec (a brute-force
`vec0` table, through apsw) was measured against this at 10K and 100K chunks: the numpy scan searched 2-4x
faster; docs/benchmarks.md has the figures and why the blobs won.
"""
from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unmask.retrieval.index import ChunkIndex, NewChunk
from unmask.store.db import Connections

SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY, store_id TEXT NOT NULL, file_id TEXT NOT NULL, chunk_index INTEGER NOT NULL,
    text TEXT NOT NULL, vector BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_by_store ON chunks (store_id, file_id);
CREATE INDEX IF NOT EXISTS chunks_by_file ON chunks (file_id);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5 (text, content='chunks', content_rowid='id',
                                                        tokenize='porter unicode61');
CREATE TRIGGER IF NOT EXISTS chunks_added AFTER INSERT ON chunks BEGIN
    INSERT INTO chunks_fts (rowid, text) VALUES (new.id, new.text); END;
CREATE TRIGGER IF NOT EXISTS chunks_removed AFTER DELETE ON chunks BEGIN
    INSERT INTO chunks_fts (chunks_fts, rowid, text) VALUES ('delete', old.id, old.text); END;
"""


@dataclass
class _Matrix:
    generation: int
    ids: np.ndarray        # [n] chunk ids
    files: np.ndarray      # [n] file ids (object)
    vectors: np.ndarray    # [n, d] float32


def _in(values: list[str]) -> str:
    return ",".join("?" * len(values))


class SQLiteIndex(ChunkIndex):
    def __init__(self, path: Path, dimension: int):
        self.path, self.dimension = Path(path), dimension
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conns = Connections(self._connect)
        self._lock = threading.Lock()
        self._generation: dict[str, int] = {}
        self._matrices: dict[str, _Matrix] = {}
        self.conn.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: a commit survives the process dying
        return conn

    @property
    def conn(self) -> sqlite3.Connection:
        return self._conns.get()

    def _changed(self, *store_ids: str) -> None:
        with self._lock:
            for s in store_ids:
                self._generation[s] = self._generation.get(s, 0) + 1
                self._matrices.pop(s, None)

    def add(self, store_id: str, file_id: str, chunks: list[NewChunk]) -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("DELETE FROM chunks WHERE store_id = ? AND file_id = ?", (store_id, file_id))
            conn.executemany("INSERT INTO chunks (store_id, file_id, chunk_index, text, vector) VALUES (?, ?, ?, ?, ?)",
                             [(store_id, file_id, c.index, c.text, np.asarray(c.vector, "<f4").tobytes())
                              for c in chunks])
            ids = [r[0] for r in conn.execute("SELECT id FROM chunks WHERE store_id = ? AND file_id = ? ORDER BY id",
                                              (store_id, file_id))]
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        # the ids ascend in insertion order, the order of `chunks`
        vectors = np.array([np.asarray(c.vector, np.float32) for c in chunks], np.float32).reshape(len(chunks),
                                                                                                   self.dimension)
        self._extend(store_id, file_id, np.array(ids, np.int64), vectors)

    def _extend(self, store_id: str, file_id: str, ids: np.ndarray, vectors: np.ndarray) -> None:
        """A new generation of the store's cached matrix with the file's rows replaced by these, when the cache is
        current; else the cache is dropped as on any change. A reader that cached a snapshot taken after the
        commit loses nothing: the file's rows in it are the ones replaced."""
        with self._lock:
            generation = self._generation.get(store_id, 0) + 1
            self._generation[store_id] = generation
            cached = self._matrices.pop(store_id, None)
            if cached is None or cached.generation != generation - 1:
                return
            keep = cached.files != file_id
            self._matrices[store_id] = _Matrix(
                generation, np.concatenate([cached.ids[keep], ids]),
                np.concatenate([cached.files[keep], np.full(len(ids), file_id, object)]),
                np.concatenate([cached.vectors[keep], vectors]))

    def delete_file(self, file_id: str, store_id: str | None = None) -> int:
        if store_id is None:
            stores = [r[0] for r in self.conn.execute("SELECT DISTINCT store_id FROM chunks WHERE file_id = ?",
                                                      (file_id,))]
            n = self.conn.execute("DELETE FROM chunks WHERE file_id = ?", (file_id,)).rowcount
        else:
            stores = [store_id]
            n = self.conn.execute("DELETE FROM chunks WHERE store_id = ? AND file_id = ?", (store_id, file_id)).rowcount
        self._changed(*stores)
        return n

    def delete_store(self, store_id: str) -> None:
        self.conn.execute("DELETE FROM chunks WHERE store_id = ?", (store_id,))
        self._changed(store_id)

    def count(self, store_id: str) -> int:
        return self.conn.execute("SELECT count(*) FROM chunks WHERE store_id = ?", (store_id,)).fetchone()[0]

    def keyword(self, store_ids, words, limit, file_ids):
        match = " OR ".join('"' + w.replace('"', "") + '"' for w in words)
        sql = ("SELECT c.id, -bm25(chunks_fts) FROM chunks_fts JOIN chunks c ON c.id = chunks_fts.rowid "
               f"WHERE chunks_fts MATCH ? AND c.store_id IN ({_in(store_ids)})")
        args: list = [match, *store_ids]
        if file_ids is not None:
            sql += f" AND c.file_id IN ({_in(file_ids)})"
            args += file_ids
        return [(cid, float(s)) for cid, s in self.conn.execute(sql + " ORDER BY bm25(chunks_fts) LIMIT ?",
                                                               (*args, limit))]

    def _matrix(self, store_id: str) -> _Matrix:
        with self._lock:
            generation = self._generation.get(store_id, 0)
            cached = self._matrices.get(store_id)
        if cached is not None and cached.generation == generation:
            return cached
        rows = self.conn.execute("SELECT id, file_id, vector FROM chunks WHERE store_id = ? ORDER BY id",
                                 (store_id,)).fetchall()
        vectors = (np.frombuffer(b"".join(r[2] for r in rows), dtype="<f4").reshape(len(rows), self.dimension)
                   if rows else np.zeros((0, self.dimension), np.float32))
        m = _Matrix(generation, np.array([r[0] for r in rows], np.int64), np.array([r[1] for r in rows], object),
                    vectors)
        with self._lock:
            if self._generation.get(store_id, 0) == generation:   # not changed while reading
                self._matrices[store_id] = m
        return m

    def vector(self, store_ids, query, limit, file_ids):
        parts = [self._matrix(s) for s in store_ids]
        ids = np.concatenate([m.ids for m in parts])
        if not len(ids):
            return []
        scores = np.concatenate([m.vectors @ np.asarray(query, np.float32) for m in parts])
        if file_ids is not None:
            keep = np.isin(np.concatenate([m.files for m in parts]), np.array(file_ids, object))
            ids, scores = ids[keep], scores[keep]
        k = min(limit, len(scores))
        if not k:
            return []
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(ids[i]), float(scores[i])) for i in top]

    def _chunk_rows(self, chunk_ids):
        return self.conn.execute(f"SELECT id, store_id, file_id, chunk_index, text FROM chunks "
                                 f"WHERE id IN ({_in(chunk_ids)})", chunk_ids).fetchall()

    def close(self) -> None:
        self._conns.close()
