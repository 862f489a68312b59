"""The file store: bytes on disk under `<data dir>/files/<id>`, metadata in SQLite.

Stable interface for other packages (the Files API routes, the batch runner, vector stores):

    store = FileStore(db, root, max_bytes)
    f = store.create(stream_or_bytes, filename, purpose)   # -> StoredFile; FileTooLargeError over max_bytes
    store.get(file_id)          # -> StoredFile (id, purpose, filename, bytes, created_at, expires_at)
    store.read_bytes(file_id)   # -> bytes
    store.path(file_id)         # -> Path of the bytes (read-only use)
    store.list(purpose=None, limit=10000, after=None, order="desc")   # -> (files, has_more)
    store.delete(file_id)       # -> StoredFile; then calls every hook in store.on_delete
    store.on_delete.append(callback)   # callback(StoredFile), after the row and the bytes are gone

Unknown ids raise FileNotFound. Writes are atomic: the bytes go to a temporary file that is renamed into
place before the row is inserted, so a crash never leaves a row without its bytes (at worst bytes without a
row, which `sweep()` removes when the store opens). Deleting removes the row first for the same reason. A file
is stored under its generated id, never under the client's filename, so no name can reach outside the root.
"""
from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from unmask.errors import UnmaskError
from unmask.store.db import Database

logger = logging.getLogger("unmask.store")

UPLOAD_PURPOSES = ("assistants", "batch", "user_data")     # what clients may upload
PURPOSES = (*UPLOAD_PURPOSES, "batch_output")                # batch_output: written by the batch runner
DEFAULT_MAX_FILE_BYTES = 512 * 2**20                          # OpenAI's per-file limit
LIST_LIMIT_MAX = 10_000
CHUNK = 1 << 20


class FileNotFound(UnmaskError):
    def __init__(self, file_id: str):
        super().__init__(f"no file with id {file_id!r}")
        self.file_id = file_id


class FileTooLargeError(UnmaskError):
    def __init__(self, limit: int):
        super().__init__(f"the file is larger than this server's limit of {limit} bytes (--max-file-bytes)")
        self.limit = limit


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _row(row) -> StoredFile:
    return StoredFile(row["id"], row["purpose"], row["filename"], row["bytes"], row["created_at"], row["expires_at"])


class FileStore:
    def __init__(self, db: Database, root: Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.db, self.max_bytes = db, max_bytes
        self.dir = Path(root) / "files"
        self.tmp = Path(root) / "tmp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.on_delete: list[Callable[[StoredFile], None]] = []
        self.sweep()

    def path(self, file_id: str) -> Path:
        return self.dir / self.get(file_id).id   # the id as stored: generated, so a plain name

    def create(self, source: BinaryIO | bytes, filename: str, purpose: str,
               max_bytes: int | None = None) -> StoredFile:
        """Store `source` (bytes or a binary stream read to its end); `max_bytes` defaults to the store's limit."""
        if purpose not in PURPOSES:
            raise ValueError(f"unknown purpose {purpose!r}")
        file_id = "file-" + secrets.token_hex(12)
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix=file_id + ".")
        try:
            with os.fdopen(fd, "wb") as out:
                size = self._copy(source, out, self.max_bytes if max_bytes is None else max_bytes)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.dir / file_id)
            _fsync_dir(self.dir)   # the rename itself survives a power loss before the row is written
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        stored = StoredFile(file_id, purpose, Path(filename or "file").name or "file", size, int(time.time()))
        self.db.conn.execute(
            "INSERT INTO files (id, purpose, filename, bytes, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
            (stored.id, stored.purpose, stored.filename, stored.bytes, stored.created_at, stored.expires_at))
        return stored

    @staticmethod
    def _copy(source: BinaryIO | bytes, out: BinaryIO, limit: int) -> int:
        if isinstance(source, (bytes, bytearray, memoryview)):
            if len(source) > limit:
                raise FileTooLargeError(limit)
            out.write(source)
            return len(source)
        size = 0
        while chunk := source.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise FileTooLargeError(limit)
            out.write(chunk)
        return size

    def get(self, file_id: str) -> StoredFile:
        row = self.db.conn.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise FileNotFound(file_id)
        return _row(row)

    def read_bytes(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

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
        (self.dir / stored.id).unlink(missing_ok=True)
        for hook in list(self.on_delete):
            try:
                hook(stored)
            except Exception:  # noqa: BLE001 - one subscriber's failure must not undo the delete or skip the rest
                logger.exception("file delete hook %r failed for %s", hook, stored.id)
        return stored

    def sweep(self) -> int:
        """Remove bytes without a row and stale temporary files (left by a crash mid-write); returns the count."""
        known = {r[0] for r in self.db.conn.execute("SELECT id FROM files")}
        removed = 0
        for path in [*self.dir.iterdir(), *self.tmp.iterdir()]:
            if path.parent == self.tmp or path.name not in known:
                path.unlink(missing_ok=True)
                removed += 1
        return removed
