"""The embedded SQLite database under a data directory: WAL mode, one connection per thread.

sqlite3 connections are not shared between threads; each thread (the event loop's, the thread pool's, a
test's) gets its own, opened on first use. WAL lets readers run beside the one writer, and `busy_timeout`
makes a writer that finds the database locked wait instead of failing. Writes that must happen together go
through `transaction()` (BEGIN IMMEDIATE: the write lock is taken up front, so two transactions never
deadlock upgrading a read lock).
"""
from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from unmask.errors import UnmaskError
from unmask.store.schema import migrate

DB_NAME = "unmask.db"
BUSY_TIMEOUT_MS = 30_000
T = TypeVar("T")


def default_data_dir() -> Path:
    """UNMASK_DATA_DIR, else $XDG_DATA_HOME/unmask, else ~/.local/share/unmask."""
    if os.environ.get("UNMASK_DATA_DIR"):
        return Path(os.environ["UNMASK_DATA_DIR"]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "unmask"



class StoreUnavailable(UnmaskError):
    """The store's database does not answer (down, unreachable, out of connections): the API answers 503, the
    background workers retry."""


RETRY_FIRST_S, RETRY_MAX_S = 0.5, 5.0   # the cap: the 503's Retry-After


def retry_while_unavailable(attempt: Callable[[], T], stop: threading.Event,
                            on_unavailable: Callable[[StoreUnavailable, float], None]) -> T | None:
    """attempt() until it does not raise StoreUnavailable (its value), waiting RETRY_FIRST_S after the first
    refusal, twice as long after each next one, up to RETRY_MAX_S; None once `stop` is set. on_unavailable(error,
    seconds to the next try) is told of each refusal (to log it, to answer 503 meanwhile)."""
    delay = RETRY_FIRST_S
    while not stop.is_set():
        try:
            return attempt()
        except StoreUnavailable as e:
            on_unavailable(e, delay)
        if stop.wait(delay):
            break
        delay = min(2 * delay, RETRY_MAX_S)
    return None

class Connections:
    """One database connection per thread (neither sqlite3's nor psycopg's are shared between threads)."""

    def __init__(self, connect: Callable[[], object]):
        self._connect, self._local, self._all, self._lock = connect, threading.local(), [], threading.Lock()

    def get(self):
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(conn, "closed", False):
            conn = self._local.conn = self._connect()
            with self._lock:
                self._all.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
        self._local = threading.local()


class Database:
    dialect = "sqlite"   # pg.py's PostgresDatabase: "postgres"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conns = Connections(self._connect)
        migrate(self.conn)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=BUSY_TIMEOUT_MS / 1000)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: a commit survives the process dying
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        return conn

    @property
    def conn(self) -> sqlite3.Connection:
        """This thread's connection (autocommit: a statement outside `transaction()` commits at once)."""
        return self._conns.get()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        self._conns.close()
