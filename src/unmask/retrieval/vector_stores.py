"""Vector stores: their metadata, background ingestion, and search.

Metadata lives in `<data dir>/retrieval.db` (SQLite, WAL), beside the file store's `unmask.db`; with the
default backend the chunks live in the same file (sqlite_index.py), with `--vector-store postgresql://...` in
Postgres. A store in Postgres (`--database-url`, store/pg.py) holds the metadata too, in its own tables (created
by pg.py's migrations), and the chunks unless `--vector-store` names another database. A vector store file row is
the ingestion queue: a row `in_progress` is work to do, so a restart resumes whatever had not completed (the
worker picks such rows up when it starts). One worker thread ingests (extract, chunk, embed, index), one file at
a time, and only a row it has claimed (store/claims.py: one conditional UPDATE of the row's owner and lease,
renewed by a heartbeat thread; the outcome is written only while the claim is held), so several server processes
on one data directory (or one Postgres database) ingest each file once.

Deletion: the file store calls `file_deleted` synchronously from its delete, which removes the file's rows and
its chunks in every store before the DELETE /v1/files answers. A worker that finishes a file whose row was
removed meanwhile removes the chunks it just wrote (row first, chunks second on both sides, so no order of the
two leaves chunks behind).
"""
from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unmask.retrieval.chunking import ChunkingStrategy, chunk_text
from unmask.retrieval.encoder import SentenceEncoder
from unmask.retrieval.extract import ExtractError, extract_text
from unmask.retrieval.filters import matches
from unmask.retrieval.index import ChunkIndex, Hit, NewChunk, open_index
from unmask.store import FileNotFound, StoreUnavailable
from unmask.store.claims import Claims, Heartbeat
from unmask.store.db import Connections

logger = logging.getLogger("unmask.retrieval")
DB_NAME = "retrieval.db"
EMBED_BATCH = 64

SCHEMA = """
CREATE TABLE IF NOT EXISTS vector_stores (
    seq INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, name TEXT, created_at INTEGER NOT NULL,
    last_active_at INTEGER NOT NULL, metadata TEXT NOT NULL DEFAULT '{}', expires_after TEXT);
CREATE TABLE IF NOT EXISTS vector_store_files (
    seq INTEGER PRIMARY KEY, store_id TEXT NOT NULL, file_id TEXT NOT NULL, filename TEXT NOT NULL,
    created_at INTEGER NOT NULL, status TEXT NOT NULL, last_error TEXT, attributes TEXT NOT NULL DEFAULT '{}',
    chunking TEXT NOT NULL, usage_bytes INTEGER NOT NULL DEFAULT 0, batch_id TEXT, owner TEXT, lease_until REAL,
    UNIQUE (store_id, file_id));
CREATE INDEX IF NOT EXISTS vsf_status ON vector_store_files (status);
CREATE INDEX IF NOT EXISTS vsf_file ON vector_store_files (file_id);
CREATE TABLE IF NOT EXISTS vector_store_batches (
    seq INTEGER PRIMARY KEY, id TEXT UNIQUE NOT NULL, store_id TEXT NOT NULL, created_at INTEGER NOT NULL,
    cancelled INTEGER NOT NULL DEFAULT 0);
"""
STATUSES = ("in_progress", "completed", "failed", "cancelled")


class NotFound(LookupError):
    def __init__(self, what: str, ident: str, param: str):
        super().__init__(f"no {what} with id {ident!r}")
        self.param = param


@dataclass
class Attach:
    file_id: str
    filename: str
    attributes: dict[str, Any]
    chunking: ChunkingStrategy


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _counts(rows) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for status, n in rows:
        counts[status] = n
    return {**counts, "total": sum(counts.values())}


@dataclass
class VectorStores:
    root: Path
    encoder: SentenceEncoder
    index: ChunkIndex
    files: Any                      # unmask.store.FileStore
    database: Any = None            # the store's PostgresDatabase (None: retrieval.db under root)
    _conns: Connections = field(init=False)
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _worker: threading.Thread | None = None
    _heartbeat: Heartbeat | None = None

    def __post_init__(self):
        self._conns = Connections(self._connect)
        self.claims = Claims(lambda: self.db, "vector_store_files", "seq")
        if self.database is not None:
            return
        self.db.executescript(SCHEMA)
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(vector_store_files)")}
        for column in ("owner TEXT", "lease_until REAL"):   # a retrieval.db from before claims
            if column.split()[0] not in columns:
                self.db.execute(f"ALTER TABLE vector_store_files ADD COLUMN {column}")

    @classmethod
    def open(cls, root: Path, encoder: SentenceEncoder, files, vector_store_url: str | None = None) -> VectorStores:
        database = files.db if files.db.dialect == "postgres" else None
        url = vector_store_url or (database.url if database is not None else None)
        index = open_index(url, Path(root) / DB_NAME, encoder.dimension)
        service = cls(Path(root), encoder, index, files, database)
        files.on_delete.append(service.file_deleted)
        return service

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.root / DB_NAME, isolation_level=None, check_same_thread=False, timeout=30)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    @property
    def db(self):   # this thread's sqlite3 connection to retrieval.db, or the store's Postgres connection
        return self.database.conn if self.database is not None else self._conns.get()

    # ------------------------------------------------------------------ stores
    def create_store(self, name: str | None, metadata: dict, expires_after: dict | None,
                     attach: list[Attach]) -> dict:
        now = int(time.time())
        store_id = new_id("vs_")
        self.db.execute("INSERT INTO vector_stores (id, name, created_at, last_active_at, metadata, expires_after) "
                        "VALUES (?, ?, ?, ?, ?, ?)", (store_id, name, now, now, json.dumps(metadata),
                                                      json.dumps(expires_after) if expires_after else None))
        for a in attach:
            self._attach_row(store_id, a, None)
        self._wake.set()
        return self.store(store_id)

    def _store_row(self, store_id: str) -> sqlite3.Row:
        row = self.db.execute("SELECT * FROM vector_stores WHERE id = ?", (store_id,)).fetchone()
        if row is None:
            raise NotFound("vector store", store_id, "vector_store_id")
        return row

    def store(self, store_id: str) -> dict:
        row = self._store_row(store_id)
        counts = _counts(self.db.execute("SELECT status, count(*) FROM vector_store_files WHERE store_id = ? "
                                         "GROUP BY status", (store_id,)))
        usage = self.db.execute("SELECT coalesce(sum(usage_bytes), 0) FROM vector_store_files WHERE store_id = ?",
                                (store_id,)).fetchone()[0]
        expires_after = json.loads(row["expires_after"]) if row["expires_after"] else None
        expires_at = row["last_active_at"] + 86400 * expires_after["days"] if expires_after else None
        status = ("expired" if expires_at is not None and time.time() > expires_at
                  else "in_progress" if counts["in_progress"] else "completed")
        return {"id": row["id"], "object": "vector_store", "created_at": row["created_at"], "name": row["name"],
                "usage_bytes": usage, "file_counts": counts, "status": status, "expires_after": expires_after,
                "expires_at": expires_at, "last_active_at": row["last_active_at"],
                "metadata": json.loads(row["metadata"])}

    def modify_store(self, store_id: str, changes: dict) -> dict:
        self._store_row(store_id)
        for key in ("name", "metadata", "expires_after"):
            if key in changes:
                value = changes[key]
                self.db.execute(f"UPDATE vector_stores SET {key} = ? WHERE id = ?",
                                (value if key == "name" else json.dumps(value) if value is not None else None,
                                 store_id))
        return self.store(store_id)

    def delete_store(self, store_id: str) -> None:
        self._store_row(store_id)
        self.db.execute("DELETE FROM vector_stores WHERE id = ?", (store_id,))
        self.db.execute("DELETE FROM vector_store_files WHERE store_id = ?", (store_id,))
        self.db.execute("DELETE FROM vector_store_batches WHERE store_id = ?", (store_id,))
        self.index.delete_store(store_id)

    def page(self, table: str, where: str, args: tuple, limit: int, order: str, after: str | None,
             before: str | None, id_column: str = "id") -> tuple[list[sqlite3.Row], bool]:
        """A page of rows in creation order (`after` / `before`: ids of the previous page's ends)."""
        for cursor, op in ((after, "<" if order == "desc" else ">"), (before, ">" if order == "desc" else "<")):
            if cursor is not None:
                row = self.db.execute(f"SELECT seq FROM {table} WHERE {where} AND {id_column} = ?",
                                      (*args, cursor)).fetchone()
                if row is None:
                    raise NotFound("object", cursor, "after" if cursor is after else "before")
                where, args = f"{where} AND seq {op} ?", (*args, row["seq"])
        rows = self.db.execute(f"SELECT * FROM {table} WHERE {where} ORDER BY seq {order.upper()} LIMIT ?",
                               (*args, limit + 1)).fetchall()
        return rows[:limit], len(rows) > limit

    def list_stores(self, limit: int, order: str, after: str | None, before: str | None):
        rows, more = self.page("vector_stores", "1 = 1", (), limit, order, after, before)
        return [self.store(r["id"]) for r in rows], more

    # ------------------------------------------------------------------ files
    def _attach_row(self, store_id: str, a: Attach, batch_id: str | None) -> None:
        """Attach (or re-attach: the file is ingested again with the new settings) a file as `in_progress`."""
        self.db.execute(
            "INSERT INTO vector_store_files (store_id, file_id, filename, created_at, status, attributes, chunking, "
            "batch_id) VALUES (?, ?, ?, ?, 'in_progress', ?, ?, ?) ON CONFLICT (store_id, file_id) DO UPDATE SET "
            "status = 'in_progress', last_error = NULL, attributes = excluded.attributes, "
            "chunking = excluded.chunking, batch_id = excluded.batch_id",
            (store_id, a.file_id, a.filename, int(time.time()), json.dumps(a.attributes),
             json.dumps([a.chunking.max_tokens, a.chunking.overlap]), batch_id))

    def attach(self, store_id: str, a: Attach) -> dict:
        self._store_row(store_id)
        self._attach_row(store_id, a, None)
        self._wake.set()
        return self.file(store_id, a.file_id)

    def _file_row(self, store_id: str, file_id: str) -> sqlite3.Row:
        self._store_row(store_id)
        row = self.db.execute("SELECT * FROM vector_store_files WHERE store_id = ? AND file_id = ?",
                              (store_id, file_id)).fetchone()
        if row is None:
            raise NotFound("file in this vector store", file_id, "file_id")
        return row

    @staticmethod
    def file_object(row: sqlite3.Row) -> dict:
        size, overlap = json.loads(row["chunking"])
        return {"id": row["file_id"], "object": "vector_store.file", "usage_bytes": row["usage_bytes"],
                "created_at": row["created_at"], "vector_store_id": row["store_id"], "status": row["status"],
                "last_error": json.loads(row["last_error"]) if row["last_error"] else None,
                "chunking_strategy": ChunkingStrategy(size, overlap).to_api(),
                "attributes": json.loads(row["attributes"])}

    def file(self, store_id: str, file_id: str) -> dict:
        return self.file_object(self._file_row(store_id, file_id))

    def update_attributes(self, store_id: str, file_id: str, attributes: dict) -> dict:
        self._file_row(store_id, file_id)
        self.db.execute("UPDATE vector_store_files SET attributes = ? WHERE store_id = ? AND file_id = ?",
                        (json.dumps(attributes), store_id, file_id))
        return self.file(store_id, file_id)

    def detach(self, store_id: str, file_id: str) -> None:
        self._file_row(store_id, file_id)
        self.db.execute("DELETE FROM vector_store_files WHERE store_id = ? AND file_id = ?", (store_id, file_id))
        self.index.delete_file(file_id, store_id)

    def list_files(self, store_id: str, limit: int, order: str, after: str | None, before: str | None,
                   status: str | None, batch_id: str | None = None):
        self._store_row(store_id)
        where, args = "store_id = ?", (store_id,)
        if status is not None:
            where, args = where + " AND status = ?", (*args, status)
        if batch_id is not None:
            where, args = where + " AND batch_id = ?", (*args, batch_id)
        rows, more = self.page("vector_store_files", where, args, limit, order, after, before, "file_id")
        return [self.file_object(r) for r in rows], more

    def file_deleted(self, stored) -> None:
        """The file store's delete hook: the file leaves every vector store and every search now."""
        self.db.execute("DELETE FROM vector_store_files WHERE file_id = ?", (stored.id,))
        self.index.delete_file(stored.id)

    # ------------------------------------------------------------------ batches
    def create_batch(self, store_id: str, attach: list[Attach]) -> dict:
        self._store_row(store_id)
        batch_id = new_id("vsfb_")
        self.db.execute("INSERT INTO vector_store_batches (id, store_id, created_at) VALUES (?, ?, ?)",
                        (batch_id, store_id, int(time.time())))
        for a in attach:
            self._attach_row(store_id, a, batch_id)
        self._wake.set()
        return self.batch(store_id, batch_id)

    def batch(self, store_id: str, batch_id: str) -> dict:
        self._store_row(store_id)
        row = self.db.execute("SELECT * FROM vector_store_batches WHERE id = ? AND store_id = ?",
                              (batch_id, store_id)).fetchone()
        if row is None:
            raise NotFound("file batch", batch_id, "batch_id")
        counts = _counts(self.db.execute("SELECT status, count(*) FROM vector_store_files WHERE batch_id = ? "
                                         "GROUP BY status", (batch_id,)))
        status = ("in_progress" if counts["in_progress"] else "cancelled" if row["cancelled"] else
                  "failed" if counts["failed"] and not counts["completed"] else "completed")
        return {"id": batch_id, "object": "vector_store.files_batch", "created_at": row["created_at"],
                "vector_store_id": store_id, "status": status, "file_counts": counts}

    def cancel_batch(self, store_id: str, batch_id: str) -> dict:
        self.batch(store_id, batch_id)
        self.db.execute("UPDATE vector_store_batches SET cancelled = 1 WHERE id = ?", (batch_id,))
        self.db.execute("UPDATE vector_store_files SET status = 'cancelled' WHERE batch_id = ? AND "
                        "status = 'in_progress'", (batch_id,))
        return self.batch(store_id, batch_id)

    # ------------------------------------------------------------------ search
    def search(self, store_ids: list[str], query: str, limit: int, mode: str = "hybrid",
               filters: dict | None = None, score_threshold: float = 0.0) -> list[tuple[Hit, dict, str]]:
        """(hit, the file's attributes, its filename), best first."""
        now = int(time.time())
        for s in store_ids:
            self._store_row(s)
            self.db.execute("UPDATE vector_stores SET last_active_at = ? WHERE id = ?", (now, s))
        marks = ",".join("?" * len(store_ids))
        rows = self.db.execute(f"SELECT store_id, file_id, filename, attributes FROM vector_store_files "
                               f"WHERE store_id IN ({marks}) AND status = 'completed'", store_ids).fetchall()
        files = {(r["store_id"], r["file_id"]): (json.loads(r["attributes"]), r["filename"]) for r in rows}
        allowed = sorted({f for (_, f), (attrs, _) in files.items() if filters is None or matches(filters, attrs)})
        vector = self.encoder.encode_texts([query]).vectors[0] if mode != "keyword" else None
        hits = self.index.search(store_ids, query, vector, limit, mode, allowed, score_threshold)
        return [(h, *files[(h.store_id, h.file_id)]) for h in hits if (h.store_id, h.file_id) in files]

    # ------------------------------------------------------------------ ingestion
    def start(self) -> None:
        self._worker = threading.Thread(target=self._run, name="unmask-ingest", daemon=True)
        self._worker.start()
        self._heartbeat = Heartbeat(self.claims.renew, "unmask-ingest-leases").start()
        self._wake.set()   # rows left in_progress by a restart

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._worker is not None:
            self._worker.join(timeout)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self.index.close()
        self._conns.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            try:
                self._ingest_claimable()
            except StoreUnavailable as e:   # --database-url's server down: keep the worker, try again later
                logger.warning("ingestion: %s; retrying", e)

    def _ingest_claimable(self) -> None:
        self.claims.sweep()   # rows of a crashed process of this machine: free at once
        while not self._stop.is_set():
            row = self._claim_next()
            if row is None:
                break
            try:
                self._ingest(row)
            finally:
                self.claims.release(row["seq"])

    def _claim_next(self) -> sqlite3.Row | None:
        """The oldest row to ingest that this worker could claim (None: none left, or all held by others)."""
        while True:
            free, args = self.claims.free_sql()
            rows = self.db.execute(f"SELECT seq FROM vector_store_files WHERE status = 'in_progress' AND {free} "
                                   "ORDER BY seq LIMIT 16", args).fetchall()
            if not rows:
                return None
            for r in rows:
                if self.claims.claim(r["seq"]):   # another worker may have taken it since the SELECT
                    row = self.db.execute("SELECT * FROM vector_store_files WHERE seq = ? AND status = "
                                          "'in_progress'", (r["seq"],)).fetchone()
                    if row is not None:
                        return row
                    self.claims.release(r["seq"])

    def _finish(self, row: sqlite3.Row, status: str, usage: int = 0, error: dict | None = None) -> bool:
        """Record the outcome unless the row changed meanwhile (detached, re-attached, cancelled) or this worker's
        claim on it was lost."""
        return self.db.execute(
            "UPDATE vector_store_files SET status = ?, usage_bytes = ?, last_error = ? WHERE seq = ? AND "
            "status = 'in_progress' AND chunking = ? AND coalesce(batch_id, '') = coalesce(?, '') AND owner = ?",
            (status, usage, json.dumps(error) if error else None, row["seq"], row["chunking"],
             row["batch_id"], self.claims.owner)).rowcount == 1

    def _ingest(self, row: sqlite3.Row) -> None:
        store_id, file_id = row["store_id"], row["file_id"]
        try:
            text = extract_text(row["filename"], self.files.read_bytes(file_id))
            size, overlap = json.loads(row["chunking"])
            _, spans = self.encoder.token_spans(text)
            chunks = chunk_text(text, spans, ChunkingStrategy(size, overlap))
            new = []
            for start in range(0, len(chunks), EMBED_BATCH):
                if self._stop.is_set():
                    return   # left in_progress: resumed after the restart
                part = chunks[start:start + EMBED_BATCH]
                vectors = self.encoder.encode_texts([c.text for c in part]).vectors
                new += [NewChunk(c.index, c.text, v) for c, v in zip(part, vectors)]
            self.index.add(store_id, file_id, new)
            if not self._finish(row, "completed", sum(len(c.text.encode()) + 4 * len(c.vector) for c in new)):
                current = self.db.execute("SELECT status FROM vector_store_files WHERE seq = ?",
                                          (row["seq"],)).fetchone()
                if current is None or current["status"] == "cancelled":
                    self.index.delete_file(file_id, store_id)
        except ExtractError as e:
            self._finish(row, "failed", error={"code": e.code, "message": str(e)})
        except FileNotFound:   # deleted meanwhile: the store's delete hook removed the row and the chunks
            return
        except StoreUnavailable:   # not the file's fault: it stays in progress and is ingested later
            raise
        except Exception as e:  # noqa: BLE001 - one bad file must not stop the worker; it is reported on the file
            logger.exception("ingesting %s into %s failed", file_id, store_id)
            self._finish(row, "failed", error={"code": "server_error", "message": f"{type(e).__name__}: {e}"})
