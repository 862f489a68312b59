"""Claims on rows of background work (a batch to run, a file to ingest), so that any number of server processes on
one database (two `unmask serve` on one data directory, the replicas of `unmask serve --ray` on one machine) take
each row exactly once.

A claim is two columns of the row, `owner` and `lease_until`, set by one conditional UPDATE that succeeds
(rowcount 1) only while the row is free: no owner, a lease run out, or an owner known to be gone. The owner renews
its leases while it works (`Heartbeat`), fences its state changes on still holding the claim (`holds`, or
`owner = ?` in the UPDATE), and gives the row back when done. A lease in a column rather than a lock held by a
transaction: work runs for minutes to hours, and a SQLite write transaction locks the whole database.

An owner that crashed elsewhere holds its rows until its lease runs out (LEASE_S). One on this machine is known
to be gone at once, so that `unmask serve` restarted after a crash resumes its work without waiting: an owner
names its host, its PID namespace and its PID, and a row whose owner has the same host and namespace and a PID
no longer running is released (`sweep`). A PID reused since only delays that to the lease's end.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("unmask.store")

LEASE_S = 15.0   # a claim not renewed for this long may be taken by another process
RENEW_S = 3.0    # how often a Heartbeat renews (several renewals per lease: one late one loses nothing)
COLUMNS = "owner TEXT, lease_until REAL"   # what a table of claimable rows adds


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")   # e.g. pid:[4026531836]; two containers differ here
    except OSError:
        return ""


def process_owner() -> str:
    """A fresh owner name for one worker of this process: host|pid namespace|pid|random."""
    return f"{socket.gethostname()}|{_pid_namespace()}|{os.getpid()}|{secrets.token_hex(4)}"


def owner_gone(owner: str) -> bool:
    """Whether `owner` is provably no longer running: a process of this host and PID namespace that has exited."""
    parts = owner.split("|")
    if len(parts) != 4 or parts[0] != socket.gethostname() or parts[1] != _pid_namespace() or not parts[2].isdigit():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:   # EPERM: it runs, as another user
        return False
    return False


class ClaimLost(RuntimeError):
    def __init__(self, what: str):
        super().__init__(f"{what} is no longer claimed by this process (its lease ran out and another took it)")


class Claims:
    """Claims on the rows of `table` (keyed by `key`) for one owner; `conn()` returns this thread's SQLite
    connection, in autocommit mode (each statement is its own transaction, so a claim is atomic)."""

    def __init__(self, conn: Callable[[], object], table: str, key: str, owner: str | None = None):
        self.conn, self.table, self.key = conn, table, key
        self.owner = owner or process_owner()

    def free_sql(self) -> tuple[str, tuple]:
        """A WHERE fragment (and its arguments) matching the rows this owner may claim now."""
        return "(owner IS NULL OR owner = ? OR lease_until < ?)", (self.owner, time.time())

    def claim(self, key) -> bool:
        where, args = self.free_sql()
        return self.conn().execute(f"UPDATE {self.table} SET owner = ?, lease_until = ? WHERE {self.key} = ? AND "
                                   f"{where}", (self.owner, time.time() + LEASE_S, key, *args)).rowcount == 1

    def holds(self, key) -> bool:
        return self.conn().execute(f"SELECT 1 FROM {self.table} WHERE {self.key} = ? AND owner = ?",
                                   (key, self.owner)).fetchone() is not None

    def release(self, key) -> None:
        self.conn().execute(f"UPDATE {self.table} SET owner = NULL, lease_until = NULL WHERE {self.key} = ? AND "
                            "owner = ?", (key, self.owner))

    def release_all(self) -> None:
        self.conn().execute(f"UPDATE {self.table} SET owner = NULL, lease_until = NULL WHERE owner = ?", (self.owner,))

    def renew(self) -> int:
        """Extends every lease this owner holds; returns how many."""
        return self.conn().execute(f"UPDATE {self.table} SET lease_until = ? WHERE owner = ?",
                                   (time.time() + LEASE_S, self.owner)).rowcount

    def sweep(self) -> int:
        """Releases the rows of owners that are provably gone (owner_gone); returns how many."""
        owners = [r[0] for r in self.conn().execute(f"SELECT DISTINCT owner FROM {self.table} WHERE owner IS NOT NULL "
                                                     "AND owner != ?", (self.owner,))]
        released = 0
        for owner in filter(owner_gone, owners):
            released += self.conn().execute(f"UPDATE {self.table} SET owner = NULL, lease_until = NULL WHERE "
                                            "owner = ?", (owner,)).rowcount
        return released


class Heartbeat:
    """A daemon thread that calls `renew` every RENEW_S until stopped, on its own connection: leases stay held
    while the worker is busy in a long step (embedding a large file) or its event loop is slow."""

    def __init__(self, renew: Callable[[], object], name: str, every: float = RENEW_S):
        self._renew, self._every, self._stop = renew, every, threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._renew()
            except Exception:  # noqa: BLE001 - a locked or closed database now must not end the renewals
                logger.warning("renewing claims failed", exc_info=True)
