"""Where the file store keeps the bytes of its files: on disk under the data directory (SQLite, one machine), or in
the database itself (Postgres, any number of machines: pg.py).

    contents.put(file_id, source, limit, insert_row)   # -> size; insert_row(size) records the file's row
    contents.read(file_id) / .stream(file_id) / .remove(file_id) / .sweep(known_ids)

`put` makes the bytes durable together with, or before, the row: a row never names missing bytes. `stream`
returns the file's chunks from a snapshot taken before it returns, so a delete that comes while a download runs
does not cut it short.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from unmask.errors import UnmaskError

CHUNK = 1 << 20


class FileTooLargeError(UnmaskError):
    def __init__(self, limit: int):
        super().__init__(f"the file is larger than this server's limit of {limit} bytes (--max-file-bytes)")
        self.limit = limit


def chunks(source: BinaryIO | bytes, limit: int) -> Iterator[bytes]:
    """The bytes of `source` in pieces of at most CHUNK, FileTooLargeError as soon as they pass `limit`."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) > limit:
            raise FileTooLargeError(limit)
        data = memoryview(source)
        for start in range(0, len(data), CHUNK):
            yield bytes(data[start:start + CHUNK])
        return
    size = 0
    while chunk := source.read(CHUNK):
        size += len(chunk)
        if size > limit:
            raise FileTooLargeError(limit)
        yield chunk


class Download:
    """A file's bytes as an iterator of chunks, and `close()` for when the reader stops early."""

    def __init__(self, parts: Iterator[bytes], close: Callable[[], None]):
        self.parts, self.close = parts, close

    def __iter__(self) -> Iterator[bytes]:
        return self.parts


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskContents:
    """`<root>/files/<id>`, written through `<root>/tmp` and renamed into place before the row is inserted."""

    def __init__(self, root: Path):
        self.dir, self.tmp = Path(root) / "files", Path(root) / "tmp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def put(self, file_id: str, source: BinaryIO | bytes, limit: int, insert_row: Callable[[int], None]) -> int:
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix=file_id + ".")
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                for part in chunks(source, limit):
                    out.write(part)
                    size += len(part)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.dir / file_id)
            _fsync_dir(self.dir)   # the rename itself survives a power loss before the row is written
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        insert_row(size)
        return size

    def read(self, file_id: str) -> bytes:
        return (self.dir / file_id).read_bytes()

    def stream(self, file_id: str) -> Download:
        handle = open(self.dir / file_id, "rb")   # FileNotFoundError: deleted since its row was read
        return Download(iter(lambda: handle.read(CHUNK), b""), handle.close)   # an unlink spares an open file

    def remove(self, file_id: str) -> None:
        (self.dir / file_id).unlink(missing_ok=True)

    def sweep(self, known: set[str]) -> int:
        """Remove bytes without a row and stale temporary files (left by a crash mid-write); returns the count."""
        removed = 0
        for path in [*self.dir.iterdir(), *self.tmp.iterdir()]:
            if path.parent == self.tmp or path.name not in known:
                path.unlink(missing_ok=True)
                removed += 1
        return removed


class DatabaseContents:
    """Rows of `file_chunks` (pg.py), inserted in one transaction with the file's row; deleting the row deletes
    them (ON DELETE CASCADE)."""

    def __init__(self, db):
        self.db = db

    def put(self, file_id: str, source: BinaryIO | bytes, limit: int, insert_row: Callable[[int], None]) -> int:
        size = 0
        with self.db.atomic() as conn:   # the chunk rows' foreign key is checked at the commit, after the row
            for n, part in enumerate(chunks(source, limit)):
                conn.execute("INSERT INTO file_chunks (file_id, n, data) VALUES (?, ?, ?)", (file_id, n, part))
                size += len(part)
            insert_row(size)   # db.conn on this thread: the transaction's connection
        return size

    def read(self, file_id: str) -> bytes:
        conn = self.db.connect()   # not the shared connection: a large file would hold it for the whole read
        try:
            return b"".join(r[0] for r in conn.execute(
                "SELECT data FROM file_chunks WHERE file_id = ? ORDER BY n", (file_id,)))
        finally:
            conn.close()

    def stream(self, file_id: str) -> Download:
        """Chunks read one at a time on a connection of their own, in a REPEATABLE READ transaction opened here:
        the file as it was now, even if it is deleted before the last chunk is read."""
        from psycopg import IsolationLevel

        conn = self.db.connect()
        conn.raw.autocommit = False
        conn.raw.isolation_level = IsolationLevel.REPEATABLE_READ
        try:
            count = conn.execute("SELECT count(*) FROM file_chunks WHERE file_id = ?", (file_id,)).fetchone()[0]
            if conn.execute("SELECT 1 FROM files WHERE id = ?", (file_id,)).fetchone() is None:
                raise FileNotFoundError(file_id)
        except BaseException:
            conn.close()
            raise

        def parts() -> Iterator[bytes]:
            try:
                for n in range(count):
                    yield conn.execute("SELECT data FROM file_chunks WHERE file_id = ? AND n = ?",
                                       (file_id, n)).fetchone()[0]
            finally:
                conn.close()

        return Download(parts(), conn.close)

    def remove(self, file_id: str) -> None:
        pass   # the row's delete removed the chunks

    def sweep(self, known: set[str]) -> int:
        return 0   # chunks come and go with their row, in one transaction
