"""The file store: metadata in the store's database, bytes on disk under `<data dir>/files/<id>` (SQLite) or in the
database itself (Postgres, shared by every server naming it): contents.py.

Stable interface for other packages (the Files API routes, the batch runner, vector stores):

    store = FileStore(db, root, max_bytes)
    f = store.create(stream_or_bytes, filename, purpose)   # -> StoredFile; FileTooLargeError over max_bytes
    store.get(file_id)          # -> StoredFile (id, purpose, filename, bytes, created_at, expires_at)
    store.read_bytes(file_id)   # -> bytes
    store.stream(file_id)       # -> (StoredFile, Download: an iterator of chunks with close())
    store.list(purpose=None, limit=10000, after=None, order="desc")   # -> (files, has_more)
    store.delete(file_id)       # -> StoredFile; then calls every hook in store.on_delete
    store.on_delete.append(callback)   # callback(StoredFile), after the row and the bytes are gone

Unknown ids raise FileNotFound. Writes are atomic: the bytes are durable before (disk: a temporary file renamed
into place) or with (Postgres: one transaction) the row, so a crash never leaves a row without its bytes (at worst
bytes on disk without a row, which `sweep()` removes when the store opens). Deleting removes the row first for the
same reason. A file is stored under its generated id, never under the client's filename, so no name can reach
outside the root.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from unmask.errors import UnmaskError
from unmask.store.contents import CHUNK, DatabaseContents, DiskContents, Download, FileTooLargeError
from unmask.store.db import Database

__all__ = ["FileStore", "StoredFile", "FileNotFound", "FileTooLargeError", "CHUNK", "PURPOSES", "UPLOAD_PURPOSES"]
logger = logging.getLogger("unmask.store")

UPLOAD_PURPOSES = ("assistants", "batch", "user_data")     # what clients may upload
PURPOSES = (*UPLOAD_PURPOSES, "batch_output")                # batch_output: written by the batch runner
DEFAULT_MAX_FILE_BYTES = 512 * 2**20                          # OpenAI's per-file limit
LIST_LIMIT_MAX = 10_000


class FileNotFound(UnmaskError):
    def __init__(self, file_id: str):
        super().__init__(f"no file with id {file_id!r}")
        self.file_id = file_id


@dataclass(frozen=True)
class StoredFile:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def to_api(self) -> dict:
        """The OpenAI file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "expires_at": self.expires_at, "filename": self.filename, "purpose": self.purpose,
                "status": "processed", "status_details": None}


def _row(row) -> StoredFile:
    return StoredFile(row["id"], row["purpose"], row["filename"], row["bytes"], row["created_at"], row["expires_at"])


class FileStore:
    def __init__(self, db: Database, root: Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.db, self.max_bytes = db, max_bytes
        self.contents = DatabaseContents(db) if db.dialect == "postgres" else DiskContents(root)
        self.on_delete: list[Callable[[StoredFile], None]] = []
        self.sweep()

    def create(self, source: BinaryIO | bytes, filename: str, purpose: str,
               max_bytes: int | None = None) -> StoredFile:
        """Store `source` (bytes or a binary stream read to its end); `max_bytes` defaults to the store's limit."""
        if purpose not in PURPOSES:
            raise ValueError(f"unknown purpose {purpose!r}")
        file_id = "file-" + secrets.token_hex(12)
        name, created = Path(filename or "file").name or "file", int(time.time())

        def insert_row(size: int) -> None:
            self.db.conn.execute(
                "INSERT INTO files (id, purpose, filename, bytes, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
                (file_id, purpose, name, size, created, None))

        size = self.contents.put(file_id, source, self.max_bytes if max_bytes is None else max_bytes, insert_row)
        return StoredFile(file_id, purpose, name, size, created)

    def get(self, file_id: str) -> StoredFile:
        row = self.db.conn.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise FileNotFound(file_id)
        return _row(row)

    def read_bytes(self, file_id: str) -> bytes:
        try:
            return self.contents.read(self.get(file_id).id)
        except FileNotFoundError:
            raise FileNotFound(file_id) from None

    def stream(self, file_id: str) -> tuple[StoredFile, Download]:
        """The file and its bytes, opened before this returns: a delete from here on does not cut the stream."""
        stored = self.get(file_id)
        try:
            return stored, self.contents.stream(stored.id)
        except FileNotFoundError:
            raise FileNotFound(file_id) from None

    def list(self, purpose: str | None = None, limit: int = LIST_LIMIT_MAX, after: str | None = None,
             order: str = "desc") -> tuple[list[StoredFile], bool]:
        """A page of files, newest first by default; `after` is the id the previous page ended with."""
        if order not in ("asc", "desc"):
            raise ValueError("order must be 'asc' or 'desc'")
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            row = self.db.conn.execute("SELECT seq FROM files WHERE id = ?", (after,)).fetchone()
            if row is None:
                raise FileNotFound(after)
            where.append("seq < ?" if order == "desc" else "seq > ?")
            args.append(row["seq"])
        sql = "SELECT * FROM files" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self.db.conn.execute(f"{sql} ORDER BY seq {order.upper()} LIMIT ?", (*args, limit + 1)).fetchall()
        return [_row(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, file_id: str) -> StoredFile:
        stored = self.get(file_id)
        if self.db.conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 0:
            raise FileNotFound(file_id)   # deleted by a concurrent request in between
        self.contents.remove(stored.id)
        for hook in list(self.on_delete):
            try:
                hook(stored)
            except Exception:  # noqa: BLE001 - one subscriber's failure must not undo the delete or skip the rest
                logger.exception("file delete hook %r failed for %s", hook, stored.id)
        return stored

    def sweep(self) -> int:
        """Remove bytes without a row (left by a crash mid-write); returns the count."""
        return self.contents.sweep({r[0] for r in self.db.conn.execute("SELECT id FROM files")})
