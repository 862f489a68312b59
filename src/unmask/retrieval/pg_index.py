"""The chunk index on PostgreSQL with pgvector (`--vector-store postgresql://...`), for stores past what one
SQLite file scans quickly.

Vectors are `vector(d)` columns under an HNSW index (cosine distance, `vector_cosine_ops`); a search limited to
some stores or files filters inside the index scan with pgvector's iterative scans (0.8+, `hnsw.iterative_scan =
relaxed_order`), so a selective filter still returns enough rows; results are then re-sorted exactly.
Keywords are Postgres full-text search: a stored `tsvector` (`english` configuration) under a GIN index, the
query's lexemes ORed. Postgres has no BM25, and its `ts_rank_cd` weighs no word by its rarity, which cost a third
of keyword recall on the docs benchmark (docs/benchmarks.md, issue 32 section); so each lexeme's `ts_rank` is
weighted by its BM25 IDF in the searched stores (`idf=False`: the plain `ts_rank_cd`, kept for comparison).

Connections: a small bounded pool (store/pg_pool.py, POOL_SIZE), autocommit, each borrowed for one operation, so
any number of searching threads hold at most POOL_SIZE connections, closed with the index. A database that does
not answer (at startup too) is StoreUnavailable: a 503 from the routes, a retry in the loader and the ingestion
worker. The table name carries the dimension, so two embedders never share one.
"""
from __future__ import annotations

import math

import numpy as np

from unmask.errors import UnmaskError
from unmask.retrieval.index import ChunkIndex, NewChunk
from unmask.store.db import StoreUnavailable
from unmask.store.pg import connect_options
from unmask.store.pg_pool import ConnectionPool


SCHEMA_LOCK = 0x756E6D61736B03   # pg_advisory_xact_lock key of the index's CREATE statements (store/pg.py: 01, 02)
# Connections per index: a search is a few short statements between encoder calls, which take the CPU, so more
# would mostly wait; Postgres' default max_connections is 100 for every server sharing it.
POOL_SIZE = 4


def _quote(lexeme: str) -> str:
    """A lexeme as one tsquery operand."""
    return "'" + lexeme.replace("'", "''").replace("\\", "\\\\") + "'"


def _vec(v: np.ndarray) -> str:
    return "[" + ",".join(f"{x:.7g}" for x in np.asarray(v, np.float32)) + "]"


class PostgresIndex(ChunkIndex):
    def __init__(self, url: str, dimension: int, idf: bool = True, pool_size: int = POOL_SIZE):
        try:
            import psycopg
        except ImportError:
            raise UnmaskError("--vector-store postgresql:// needs the psycopg package (pip install 'psycopg[binary]')")
        self._psycopg = psycopg
        self.url, self.dimension, self.idf = url, dimension, idf
        self.table = f"unmask_chunks_{dimension}"
        self.pool = ConnectionPool(self._connect, pool_size, psycopg.OperationalError,
                                   f"the vector store {url.split('@')[-1]}")
        try:
            with self.pool.connection() as c, c.transaction():   # one server at a time: concurrent CREATE ...
                c.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))   # IF NOT EXISTS collide
                self._create(c)
        except BaseException:
            self.pool.close()
            raise

    def _create(self, c) -> None:
        try:
            with c.transaction():   # a savepoint: the error below leaves the outer transaction usable
                c.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except self._psycopg.Error as e:
            raise UnmaskError(f"the Postgres server at {self.url.split('@')[-1]} has no pgvector extension: "
                              f"{e}") from None
        t, dimension = self.table, self.dimension
        c.execute(f"""CREATE TABLE IF NOT EXISTS {t} (
            id bigserial PRIMARY KEY, store_id text NOT NULL, file_id text NOT NULL, chunk_index int NOT NULL,
            text text NOT NULL, embedding vector({dimension}) NOT NULL,
            tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', text)) STORED)""")
        c.execute(f"CREATE INDEX IF NOT EXISTS {t}_hnsw ON {t} USING hnsw (embedding vector_cosine_ops)")
        c.execute(f"CREATE INDEX IF NOT EXISTS {t}_tsv ON {t} USING gin (tsv)")
        c.execute(f"CREATE INDEX IF NOT EXISTS {t}_store ON {t} (store_id, file_id)")
        c.execute(f"CREATE INDEX IF NOT EXISTS {t}_file ON {t} (file_id)")

    def _connect(self):
        try:
            conn = self._psycopg.connect(self.url, autocommit=True, **connect_options(self.url))
        except self._psycopg.OperationalError as e:
            raise StoreUnavailable(f"cannot connect to the vector store {self.url.split('@')[-1]}: {e}") from None
        try:
            conn.execute("SET hnsw.iterative_scan = relaxed_order")
            conn.execute("SET hnsw.ef_search = 100")
        except self._psycopg.OperationalError as e:
            conn.close()
            raise StoreUnavailable(f"the vector store {self.url.split('@')[-1]} did not answer: {e}") from None
        return conn

    def _execute(self, sql: str, args=()):
        """One statement on a connection of the pool; its rows read before the connection goes back."""
        with self.pool.connection() as c:
            cur = c.execute(sql, args)
            return cur.fetchall() if cur.description is not None else cur.rowcount

    def add(self, store_id: str, file_id: str, chunks: list[NewChunk]) -> None:
        with self.pool.connection() as conn, conn.transaction():
            cur = conn.cursor()
            cur.execute(f"DELETE FROM {self.table} WHERE store_id = %s AND file_id = %s", (store_id, file_id))
            with cur.copy(f"COPY {self.table} (store_id, file_id, chunk_index, text, embedding) FROM STDIN") as copy:
                for c in chunks:
                    copy.write_row((store_id, file_id, c.index, c.text.replace("\x00", ""), _vec(c.vector)))

    def delete_file(self, file_id: str, store_id: str | None = None) -> int:
        if store_id is None:
            return self._execute(f"DELETE FROM {self.table} WHERE file_id = %s", (file_id,))
        return self._execute(f"DELETE FROM {self.table} WHERE store_id = %s AND file_id = %s", (store_id, file_id))

    def delete_store(self, store_id: str) -> None:
        self._execute(f"DELETE FROM {self.table} WHERE store_id = %s", (store_id,))

    def count(self, store_id: str) -> int:
        return self._execute(f"SELECT count(*) FROM {self.table} WHERE store_id = %s", (store_id,))[0][0]

    def _where(self, store_ids, file_ids) -> tuple[str, list]:
        sql, args = "store_id = ANY(%s)", [list(store_ids)]
        if file_ids is not None:
            sql += " AND file_id = ANY(%s)"
            args.append(list(file_ids))
        return sql, args

    def keyword(self, store_ids, words, limit, file_ids):
        with self.pool.connection() as conn:   # one connection for the statements of one ranking
            return self._keyword(conn, store_ids, words, limit, file_ids)

    def _keyword(self, conn, store_ids, words, limit, file_ids):
        where, args = self._where(store_ids, file_ids)
        if not self.idf:
            query = " or ".join(words)   # websearch syntax: `or` between words
            rows = conn.execute(
                f"SELECT id, ts_rank_cd(tsv, q, 32) AS r FROM {self.table}, websearch_to_tsquery('english', %s) q "
                f"WHERE tsv @@ q AND {where} ORDER BY r DESC, id LIMIT %s", (query, *args, limit)).fetchall()
            return [(cid, float(r) / (1 - float(r)) if r < 1 else 1e9) for cid, r in rows]   # back to rank, >= 0
        # each query lexeme's ts_rank weighted by its BM25 inverse document frequency in the searched stores,
        # log(1 + (N - df + 0.5) / (df + 0.5)) (Robertson and Zaragoza 2009), so that rare words count more
        lexemes = [r[0] for r in conn.execute(
            "SELECT DISTINCT unnest(tsvector_to_array(to_tsvector('english', %s)))", (" ".join(words),))][:16]
        if not lexemes:
            return []
        total = conn.execute(f"SELECT count(*) FROM {self.table} WHERE {where}", args).fetchone()[0]
        weights = []
        for lexeme in lexemes:
            df = conn.execute(f"SELECT count(*) FROM {self.table} WHERE tsv @@ to_tsquery('simple', %s) "
                              f"AND {where}", (_quote(lexeme), *args)).fetchone()[0]
            if df:
                weights.append((lexeme, math.log(1 + (total - df + 0.5) / (df + 0.5))))
        if not weights:
            return []
        score = " + ".join(f"%s * ts_rank(tsv, to_tsquery('simple', %s), 1)" for _ in weights)
        params = [x for lexeme, w in weights for x in (w, _quote(lexeme))]
        rows = conn.execute(
            f"SELECT id, ({score}) AS r FROM {self.table} WHERE tsv @@ to_tsquery('simple', %s) AND {where} "
            f"ORDER BY r DESC, id LIMIT %s",
            (*params, " | ".join(_quote(lexeme) for lexeme, _ in weights), *args, limit)).fetchall()
        return [(cid, float(r)) for cid, r in rows]

    def vector(self, store_ids, query, limit, file_ids):
        where, args = self._where(store_ids, file_ids)
        q = _vec(query)
        rows = self._execute(
            f"SELECT id, 1 - (embedding <=> %s::vector) FROM {self.table} WHERE {where} "
            f"ORDER BY embedding <=> %s::vector LIMIT %s", (q, *args, q, limit))
        return sorted(((cid, float(s)) for cid, s in rows), key=lambda x: -x[1])

    def _chunk_rows(self, chunk_ids):
        return self._execute(f"SELECT id, store_id, file_id, chunk_index, text FROM {self.table} "
                             "WHERE id = ANY(%s)", (list(chunk_ids),))

    def close(self) -> None:
        self.pool.close()
