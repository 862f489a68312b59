"""A small bounded pool of psycopg connections: the chunk index's (retrieval/pg_index.py) way to Postgres.

At most `size` connections exist at once, however many threads search or ingest (the server runs requests on up
to 40 threads, and threads come and go): a thread borrows one for an operation and gives it back, and a thread
that finds all of them lent waits for one (up to `wait_s`, then StoreUnavailable: a 503 with Retry-After).
Connections open on demand, so a server that never searches opens one (the index's CREATE statements).

Not psycopg_pool, which is not a dependency here: its getconn, while the database is down, waits its whole
timeout for a background reconnection, where the store's rule (store/db.py's StoreUnavailable) is to answer 503 at
once and let the caller retry. Here a connection is opened in the borrowing thread, so a refusal is immediate.

A connection that fails (the server went away, restarted) is closed, and so are the idle ones, which most likely
went with it: the next borrower connects afresh, so a database restart costs one failed request, not one per
pooled connection.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from unmask.store.db import StoreUnavailable


class ConnectionPool:
    def __init__(self, connect: Callable[[], object], size: int, lost: type[Exception], what: str,
                 wait_s: float = 30.0):
        """connect: opens one connection (raises StoreUnavailable when the database does not answer); lost:
        the exception of a connection that broke (psycopg's OperationalError); what: the database, for messages."""
        if size < 1:
            raise ValueError(f"a connection pool needs at least one connection, not {size}")
        self.size, self.wait_s, self._connect, self._lost, self._what = size, wait_s, connect, lost, what
        self._slots = threading.BoundedSemaphore(size)   # one per connection lent or that may be opened
        self._idle: list = []
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def connection(self) -> Iterator:
        """A connection of the pool for the `with` block (autocommit as `connect` made it; a transaction inside is
        the caller's `conn.transaction()`)."""
        if not self._slots.acquire(timeout=self.wait_s):
            raise StoreUnavailable(f"all {self.size} connections to {self._what} stayed busy for {self.wait_s:g} s")
        conn = None
        try:
            with self._lock:
                if self._closed:
                    raise StoreUnavailable(f"the connections to {self._what} are closed (the server is stopping)")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._connect()
            try:
                yield conn
            except self._lost as e:
                self._discard(conn)
                conn = None
                raise StoreUnavailable(f"{self._what} did not answer: {e}") from None
        finally:
            if conn is not None:
                self._give_back(conn)
            self._slots.release()

    def _give_back(self, conn) -> None:
        reusable = not (conn.closed or conn.broken) and conn.info.transaction_status.name == "IDLE"
        with self._lock:
            if reusable and not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _discard(self, conn) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in (conn, *idle):
            c.close()

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        """Close the idle connections now and the lent ones when they come back; later borrowers get
        StoreUnavailable."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
