"""The store's database on PostgreSQL (`--database-url postgresql://...`): one set of files, batches and vector
stores for every server that names the same database, on any machine (the replicas of `unmask serve --ray` on a
multi-node cluster, several `unmask serve` behind one load balancer), whatever their `--data-dir`.

The rest of the store speaks SQLite's SQL through `conn.execute(sql, args)`; `PgConnection` runs the same
statements on Postgres: `?` placeholders become `%s`, `INSERT OR IGNORE` becomes `ON CONFLICT DO NOTHING`, and rows
are read by index or by column name as sqlite3.Row's are. The tables live in their own schema (`unmask`), so they
never meet a table of the same name in a database shared with other applications.

Connections: one shared by every thread for single statements (psycopg's connections are thread-safe; each
statement's result is read into its own cursor), and one of its own for each transaction, download or whole-file
read, closed after it. So a server holds a handful of connections, not one per thread of its pool (two replicas
with 40 threads each ran a test Postgres out of its 100). `transaction()` matches SQLite's `BEGIN IMMEDIATE`: a
transaction-level advisory lock taken up front makes the store's read-modify-write transactions (a batch's status)
run one at a time across all servers; inside it, `db.conn` on that thread is the transaction's connection. File contents are
rows of `file_chunks` (1 MiB each, written in the transaction that inserts the file's row), so an upload streams
into the database and a download streams out of it without holding the file in memory.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from unmask.errors import UnmaskError
from unmask.store.db import StoreUnavailable

SCHEMA = "unmask"
WRITE_LOCK = 0x756E6D61736B01    # pg_advisory_xact_lock keys: the store's write transactions,
MIGRATE_LOCK = 0x756E6D61736B02  # and its migrations (two servers starting at once)

# Append a migration to change the schema; never edit one that has shipped. REAL in SQLite is a double: here
# DOUBLE PRECISION (Postgres' REAL is 4 bytes, too coarse for a lease's Unix time).
MIGRATIONS: list[str] = [
    # 1: the SQLite store's tables (schema.py), the file contents as chunks, and the vector stores' metadata
    # (retrieval/vector_stores.py's SCHEMA); the chunks of vector stores are pg_index.py's table
    """
    CREATE TABLE files (
        seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL UNIQUE, purpose TEXT NOT NULL, filename TEXT NOT NULL,
        bytes BIGINT NOT NULL, created_at BIGINT NOT NULL, expires_at BIGINT);
    CREATE INDEX files_by_purpose ON files (purpose, seq);
    CREATE TABLE file_chunks (
        file_id TEXT NOT NULL REFERENCES files (id) ON DELETE CASCADE DEFERRABLE INITIALLY DEFERRED,
        n INTEGER NOT NULL, data BYTEA NOT NULL, PRIMARY KEY (file_id, n));
    CREATE TABLE batches (
        seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL UNIQUE, status TEXT NOT NULL, object TEXT NOT NULL,
        owner TEXT, lease_until DOUBLE PRECISION);
    CREATE INDEX batches_by_status ON batches (status);
    CREATE TABLE batch_results (
        batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, ok INTEGER NOT NULL, record TEXT NOT NULL,
        PRIMARY KEY (batch_id, line));
    CREATE TABLE vector_stores (
        seq BIGSERIAL PRIMARY KEY, id TEXT UNIQUE NOT NULL, name TEXT, created_at BIGINT NOT NULL,
        last_active_at BIGINT NOT NULL, metadata TEXT NOT NULL DEFAULT '{}', expires_after TEXT);
    CREATE TABLE vector_store_files (
        seq BIGSERIAL PRIMARY KEY, store_id TEXT NOT NULL, file_id TEXT NOT NULL, filename TEXT NOT NULL,
        created_at BIGINT NOT NULL, status TEXT NOT NULL, last_error TEXT, attributes TEXT NOT NULL DEFAULT '{}',
        chunking TEXT NOT NULL, usage_bytes BIGINT NOT NULL DEFAULT 0, batch_id TEXT, owner TEXT,
        lease_until DOUBLE PRECISION, UNIQUE (store_id, file_id));
    CREATE INDEX vsf_status ON vector_store_files (status);
    CREATE INDEX vsf_file ON vector_store_files (file_id);
    CREATE TABLE vector_store_batches (
        seq BIGSERIAL PRIMARY KEY, id TEXT UNIQUE NOT NULL, store_id TEXT NOT NULL, created_at BIGINT NOT NULL,
        cancelled INTEGER NOT NULL DEFAULT 0)
    """,
]


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and url.startswith(("postgresql://", "postgres://"))


# libpq waits for a host that drops packets as long as the OS does (minutes) unless told; a request thread
# stuck in connect() holds its caller that long. The URL's own connect_timeout, when it has one, wins.
CONNECT_TIMEOUT_S = 10


def connect_options(url: str) -> dict:
    """Keyword options for psycopg.connect: a connect timeout unless the URL sets its own."""
    return {} if "connect_timeout" in url else {"connect_timeout": CONNECT_TIMEOUT_S}


def where(url: str) -> str:
    """The URL without its user and password, for messages."""
    return url.split("@")[-1]


@lru_cache(maxsize=1024)
def to_postgres(sql: str) -> str:
    """A statement of the store's SQLite dialect in Postgres' (psycopg's `%s` placeholders)."""
    sql = sql.replace("%", "%%").replace("?", "%s")
    if sql.lstrip().upper().startswith("INSERT OR IGNORE "):
        sql = sql.replace("OR IGNORE ", "", 1) + " ON CONFLICT DO NOTHING"
    return sql


class Row(tuple):
    """A result row read by position or by column name, as sqlite3.Row."""

    def __new__(cls, values, names: dict[str, int]):
        row = super().__new__(cls, values)
        row._names = names
        return row

    def __getitem__(self, key):
        return super().__getitem__(self._names[key] if isinstance(key, str) else key)

    def keys(self) -> list[str]:
        return list(self._names)


def _rows(cursor):
    names = {d.name: i for i, d in enumerate(cursor.description or ())}
    return lambda values: Row(values, names)


class PgConnection:
    """One psycopg connection (autocommit: a statement outside a transaction commits at once) that runs the
    store's SQLite-dialect statements."""

    def __init__(self, raw, lost: type[Exception]):
        self.raw, self._lost = raw, lost   # lost: psycopg's OperationalError (the server went away, ...)

    def execute(self, sql: str, args=()):
        try:
            return self.raw.execute(to_postgres(sql), tuple(args))   # a tuple, even empty: `%%` is unescaped
        except self._lost as e:
            raise StoreUnavailable(f"the store's database did not answer: {e}") from None

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def close(self) -> None:
        self.raw.close()


class PostgresDatabase:
    """Database's interface (conn, transaction, close) on a Postgres server."""

    dialect = "postgres"

    def __init__(self, url: str):
        try:
            import psycopg
        except ImportError:
            raise UnmaskError("--database-url postgresql:// needs the psycopg package "
                              "(pip install 'unmask[postgres]')") from None
        self._psycopg, self.url = psycopg, url
        self._shared: PgConnection | None = None
        self._lock = threading.Lock()
        self._local = threading.local()   # .tx: the connection of the transaction this thread is in
        self._migrate()

    def connect(self, **kw) -> PgConnection:
        """A new connection of its own (autocommit), e.g. for a download's snapshot; the caller closes it."""
        try:
            raw = self._psycopg.connect(self.url, autocommit=True, row_factory=_rows,
                                        **{**connect_options(self.url), **kw})
        except self._psycopg.OperationalError as e:
            raise StoreUnavailable(f"cannot connect to the database {where(self.url)}: {e}") from None
        conn = PgConnection(raw, self._psycopg.OperationalError)
        conn.execute(f"SET search_path TO {SCHEMA}, public")   # public: where extensions such as pgvector live
        return conn

    @property
    def conn(self) -> PgConnection:
        """The connection for a statement: this thread's transaction's, else the shared one (autocommit)."""
        tx = getattr(self._local, "tx", None)
        if tx is not None:
            return tx
        with self._lock:
            if self._shared is None or self._shared.closed:   # closed: the server went away; connect again
                self._shared = self.connect()
            return self._shared

    @contextmanager
    def atomic(self) -> Iterator[PgConnection]:
        """A transaction on a connection of its own, committed at the end (rolled back on an exception)."""
        conn = self.connect()
        self._local.tx = conn
        try:
            with conn.raw.transaction():
                yield conn
        finally:
            self._local.tx = None
            conn.close()

    @contextmanager
    def transaction(self) -> Iterator[PgConnection]:
        with self.atomic() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(?)", (WRITE_LOCK,))
            yield conn

    def _migrate(self) -> int:
        with self.atomic() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATE_LOCK,))
            conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row else 0
            if version > len(MIGRATIONS):
                raise UnmaskError(f"the database {where(self.url)} is at schema version {version}, newer than this "
                                  f"unmask's {len(MIGRATIONS)}; upgrade unmask")
            for script in MIGRATIONS[version:]:
                for statement in filter(str.strip, script.split(";")):
                    conn.execute(statement)
            conn.execute("DELETE FROM schema_version")
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (len(MIGRATIONS),))
        return len(MIGRATIONS)

    def close(self) -> None:
        with self._lock:
            if self._shared is not None:
                self._shared.close()
                self._shared = None
