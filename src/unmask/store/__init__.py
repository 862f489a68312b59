"""Persistent state of `unmask serve`: an embedded SQLite database under one data directory (db.py, schema.py),
or a Postgres database that servers on several machines share (pg.py, `--database-url`), and the file store
(files.py, whose docstring is the interface other packages build on).

    store = open_store(data_dir, max_file_bytes, database_url=None)
    store.files.create(...) / .get(id) / .read_bytes(id) / .delete(id); store.files.on_delete.append(hook)
    store.db.conn / store.db.transaction()   # tables of other packages go in schema.py's migrations
"""
from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from unmask.store.db import DB_NAME, Database, StoreUnavailable, default_data_dir
from unmask.store.files import DEFAULT_MAX_FILE_BYTES, FileNotFound, FileStore, FileTooLargeError, StoredFile

__all__ = ["Store", "LazyStore", "open_store", "default_data_dir", "Database", "FileStore", "StoredFile", "FileNotFound",
           "FileTooLargeError", "DEFAULT_MAX_FILE_BYTES", "StoreUnavailable"]


@dataclass
class Store:
    root: Path
    db: Database
    files: FileStore

    def close(self) -> None:
        self.db.close()


def open_store(root: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, database_url: str | None = None) -> Store:
    """The store under `root`, or, with a postgresql:// `database_url`, in that database (`root` then holds no
    state of the store)."""
    root = Path(root)
    if database_url:
        from unmask.store.pg import PostgresDatabase

        db = PostgresDatabase(database_url)
    else:
        db = Database(root / DB_NAME)
    return Store(root, db, FileStore(db, root, max_file_bytes))


class LazyStore:
    """The server's store, opened on first use, so that a server that never touches files or batches creates no
    database. `root` None: a temporary directory, removed with this object (ServerArgs without a data dir)."""

    def __init__(self, root: Path | None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 database_url: str | None = None):
        self.root, self.max_file_bytes, self.database_url = root, max_file_bytes, database_url
        self._store: Store | None = None
        self._tmp = None
        self._lock = threading.Lock()

    @property
    def exists(self) -> bool:
        """Whether a database is already there (one to resume batches from)."""
        return (self._store is not None or bool(self.database_url)
                or (self.root is not None and (Path(self.root) / DB_NAME).exists()))

    def get(self) -> Store:
        with self._lock:
            if self._store is None:
                root = self.root
                if root is None:
                    self._tmp = tempfile.TemporaryDirectory(prefix="unmask-data-")
                    root = Path(self._tmp.name)
                self._store = open_store(root, self.max_file_bytes, self.database_url)
            return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None
