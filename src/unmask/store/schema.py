"""The database's schema, as an ordered list of migrations; `PRAGMA user_version` counts those applied.

Append a migration to change the schema; never edit one that has shipped (a data directory written by an
older unmask is brought forward by running the ones it lacks, each in its own transaction).
"""
from __future__ import annotations

import sqlite3

MIGRATIONS: list[str] = [
    # 1: files (bytes on disk under files/<id>; `seq` orders listings), batches (the API object as JSON, status
    # for the runner's queries) and one row per finished batch line (what makes a batch resumable)
    """
    CREATE TABLE files (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        purpose TEXT NOT NULL,
        filename TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        expires_at INTEGER
    );
    CREATE INDEX files_by_purpose ON files (purpose, seq);
    CREATE TABLE batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        status TEXT NOT NULL,
        object TEXT NOT NULL
    );
    CREATE INDEX batches_by_status ON batches (status);
    CREATE TABLE batch_results (
        batch_id TEXT NOT NULL,
        line INTEGER NOT NULL,
        custom_id TEXT,
        ok INTEGER NOT NULL,
        record TEXT NOT NULL,
        PRIMARY KEY (batch_id, line)
    );
    """,
    # 2: claims on batches (store/claims.py): the process running a batch and its lease, so that several server
    # processes on one database run each batch once
    """
    ALTER TABLE batches ADD COLUMN owner TEXT;
    ALTER TABLE batches ADD COLUMN lease_until REAL
    """,
]


def migrate(conn: sqlite3.Connection) -> int:
    """Apply the migrations `conn`'s database lacks; returns the schema version reached."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > len(MIGRATIONS):
        raise RuntimeError(f"the database is at schema version {version}, newer than this unmask's "
                           f"{len(MIGRATIONS)}; upgrade unmask or use another --data-dir")
    for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in filter(str.strip, script.split(";")):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {number}")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    return len(MIGRATIONS)
