"""Chunk index at scale: ingestion chunks/s and search latency p50/p99 at N chunks, per backend.

Backends: `sqlite` (unmask's: FTS5 + float32 blobs scored with numpy), `sqlite-vec` (the alternative measured
for the choice: sqlite-vec's brute-force vec0 table, vectors only), `postgres` (pgvector HNSW + full-text; a
server started here as the tests start theirs, or --pg-url). Chunks are synthetic: 384-dimension random unit
vectors (the default embedder's size; embedding time is not counted, ingestion is the index's own cost) and
60-word texts drawn from a Zipf vocabulary of 20,000 words, so that keyword queries hit long posting lists as
real text does. Queries are 200 random vectors / 3-word texts; `hybrid` is unmask's default mode. Also timed: the
first vector search after ingestion (SQLite's numpy matrix is read then) and the one right after adding one more
file to the warm store. sqlite-vec loads through the stdlib's sqlite3 where it can load extensions, else apsw.

    .venv/bin/python bench/retrieval_scale.py --chunks 10000,100000 --backends sqlite,sqlite-vec,postgres

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from unmask.retrieval.index import NewChunk  # noqa: E402

DIM, QUERIES, BATCH = 384, 200, 1000


def synthetic(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(20000)]
    ranks = np.minimum(rng.zipf(1.2, size=(n, 60)) - 1, len(vocab) - 1)
    texts = [" ".join(vocab[r] for r in row) for row in ranks]
    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    q_words = [[vocab[r] for r in np.minimum(rng.zipf(1.2, size=3) - 1, len(vocab) - 1)] for _ in range(QUERIES)]
    q_vecs = rng.standard_normal((QUERIES, DIM)).astype(np.float32)
    q_vecs /= np.linalg.norm(q_vecs, axis=1, keepdims=True)
    return texts, vectors, q_words, q_vecs


def percentiles(times: list[float]) -> tuple[float, float]:
    return float(np.percentile(times, 50) * 1000), float(np.percentile(times, 99) * 1000)


def run_index(index, texts, vectors, q_words, q_vecs, modes) -> dict:
    t0 = time.perf_counter()
    for start in range(0, len(texts), BATCH):   # one "file" per 1000 chunks
        index.add("vs_bench", f"file-{start}", [NewChunk(i, texts[i], vectors[i])
                                                 for i in range(start, min(start + BATCH, len(texts)))])
    ingest = time.perf_counter() - t0
    out = {"ingest_chunks_per_s": len(texts) / ingest}
    t = time.perf_counter()   # the first search after a change reads the store's vectors (SQLite's numpy cache)
    index.search(["vs_bench"], " ".join(q_words[0]), q_vecs[0], 10, "vector")
    out["first_vector_search_ms"] = (time.perf_counter() - t) * 1000
    for mode in modes:
        times = []
        for words, q in zip(q_words, q_vecs):
            t = time.perf_counter()
            index.search(["vs_bench"], " ".join(words), q, 10, mode)
            times.append(time.perf_counter() - t)
        out[f"{mode}_p50_ms"], out[f"{mode}_p99_ms"] = percentiles(times)
    out["search_after_adding_a_file_ms"] = _after_a_file(lambda chunks: index.add("vs_bench", "file-new", [
        NewChunk(i, texts[i], v) for i, v in enumerate(chunks)]), lambda q: index.search(
        ["vs_bench"], " ".join(q_words[0]), q, 10, "vector"), q_vecs[0])
    return out


def _after_a_file(add, search, query) -> float:
    """One more file (BATCH chunks) into the warm store, then the time of the next vector search: what a change
    costs the search after it (SQLite's cached matrix)."""
    vectors = np.random.default_rng(1).standard_normal((BATCH, DIM)).astype(np.float32)
    add(vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    t = time.perf_counter()
    search(query)
    return (time.perf_counter() - t) * 1000


def extension_connection(path: Path):
    """A connection that can load sqlite-vec: the stdlib's where it was built with loadable extensions, else
    apsw's (its own SQLite, always built with them); None when neither is available."""
    import sqlite3

    import sqlite_vec

    conn = sqlite3.connect(path, isolation_level=None)
    if hasattr(conn, "enable_load_extension"):
        conn.enable_load_extension(True)
        sqlite_vec.load(conn)
        return conn, f"stdlib sqlite3 {sqlite3.sqlite_version}"
    conn.close()
    try:
        import apsw
    except ImportError:
        return None, "this Python's sqlite3 cannot load extensions and apsw is not installed"
    conn = apsw.Connection(str(path))
    conn.enable_load_extension(True)
    conn.load_extension(sqlite_vec.loadable_path())
    return conn, f"apsw {apsw.apsw_version()}"


def run_sqlite_vec(path: Path, texts, vectors, q_words, q_vecs, modes) -> dict:
    """sqlite-vec's vec0 table (exact brute-force k-NN inside SQLite, partitioned by store), vectors only: the
    search it would replace is SQLite's numpy scan; keyword search would stay FTS5's."""
    conn, driver = extension_connection(path)
    if conn is None:
        return {"unavailable": driver}
    (version,) = conn.execute("SELECT vec_version()").fetchone()
    conn.execute(f"CREATE VIRTUAL TABLE v USING vec0(store_id text partition key, embedding float[{DIM}])")
    t0 = time.perf_counter()
    for start in range(0, len(texts), BATCH):
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO v (rowid, store_id, embedding) VALUES (?, 'vs_bench', ?)",
                         [(i + 1, vectors[i].tobytes()) for i in range(start, min(start + BATCH, len(texts)))])
        conn.execute("COMMIT")
    out = {"ingest_chunks_per_s": len(texts) / (time.perf_counter() - t0)}
    sql = "SELECT rowid, distance FROM v WHERE embedding MATCH ? AND store_id = 'vs_bench' AND k = 10"
    t = time.perf_counter()
    conn.execute(sql, (q_vecs[0].tobytes(),)).fetchall()
    out["first_vector_search_ms"] = (time.perf_counter() - t) * 1000
    times = []
    for q in q_vecs:
        t = time.perf_counter()
        conn.execute(sql, (q.tobytes(),)).fetchall()
        times.append(time.perf_counter() - t)
    out["vector_p50_ms"], out["vector_p99_ms"] = percentiles(times)
    n = len(texts)

    def add(chunks):
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO v (rowid, store_id, embedding) VALUES (?, 'vs_bench', ?)",
                         [(n + 1 + i, v.tobytes()) for i, v in enumerate(chunks)])
        conn.execute("COMMIT")

    out["search_after_adding_a_file_ms"] = _after_a_file(add, lambda q: conn.execute(sql, (q.tobytes(),)).fetchall(),
                                                         q_vecs[0])
    out["driver"] = f"sqlite-vec {version} through {driver}"
    conn.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="10000,100000")
    ap.add_argument("--backends", default="sqlite,sqlite-vec,postgres")
    ap.add_argument("--modes", default="keyword,vector,hybrid", help="search modes to time (sqlite-vec: vector only)")
    ap.add_argument("--rounds", type=int, default=1, help="run the backends this many times in turn (A B A B), "
                    "for comparisons on a loaded machine")
    ap.add_argument("--pg-url", default=None, help="an existing server (default: start one as the tests do)")
    args = ap.parse_args()
    backends, modes = args.backends.split(","), args.modes.split(",")
    pg = None
    if "postgres" in backends and not args.pg_url:
        from pg_server import start_postgres

        pg = start_postgres()
    results = []
    try:
        for n in map(int, args.chunks.split(",")):
            data = synthetic(n)
            for backend in backends * args.rounds:
                tmp = Path(tempfile.mkdtemp(prefix="unmask-bench-"))
                try:
                    if backend == "sqlite-vec":
                        row = run_sqlite_vec(tmp / "vec.db", *data, modes)
                    elif backend == "sqlite":
                        from unmask.retrieval.sqlite_index import SQLiteIndex

                        index = SQLiteIndex(tmp / "chunks.db", DIM)
                        row = run_index(index, *data, modes)
                        index.close()
                    else:
                        import psycopg

                        from unmask.retrieval.pg_index import PostgresIndex

                        url = args.pg_url or pg.url
                        with psycopg.connect(url, autocommit=True) as c:
                            c.execute(f"DROP TABLE IF EXISTS unmask_chunks_{DIM}")
                        index = PostgresIndex(url, DIM)
                        row = run_index(index, *data, modes)
                        index.close()
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                row = {"backend": backend, "chunks": n, "load_average": os.getloadavg()[0], **row}
                results.append(row)
                cells = " ".join(f"{k}={v:.1f}" for k, v in row.items() if isinstance(v, float))
                print(f"{backend:10s} {n:>7d}  {cells or row.get('unavailable')}", flush=True)
    finally:
        if pg is not None:
            pg.stop()
            shutil.rmtree(pg.root, ignore_errors=True)
    print(json.dumps({"bench": "retrieval_scale", "results": results}))


if __name__ == "__main__":
    main()
