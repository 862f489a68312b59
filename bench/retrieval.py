"""Retrieval quality on documents no one here wrote: recall@5 and MRR of keyword (BM25), vector and hybrid search.

The set: every section of the held-out Python documentation files (data/corpus/heldout.jsonl, source `docs`)
whose title has at least three words and is unique is a question; the query is the section's title, and the
answer is that section. The index holds every section of every documentation file (held-out and training
splits: thousands of distractors), with the titles removed from the text, so that a title never matches itself
word for word. A section counts as found at rank r when one of its chunks is the r-th distinct section in the
results. This asks "which section is about <topic>?", a fair stand-in for a user's question, but it is not a
set of real questions: its figures compare the modes and settings here, not the absolute quality a user sees.
`--set code` is a second set whose queries share few words with their answers (bench/retrieval_code_set.py);
on the documentation set the run also measures file_search's query in two-turn conversations
(bench/retrieval_conversations.py). `--embedding-model DIR` compares embedders (bench/embedder_dirs.py).

    .venv/bin/python bench/retrieval.py [--chunking 800,400 --chunking 200,50] [--backend sqlite|postgres]
                                        [--embedding-model DIR] [--set docs|code]

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from unmask.retrieval.chunking import ChunkingStrategy, chunk_text  # noqa: E402
from unmask.retrieval.encoder import DEFAULT_ENCODER_NAME, SentenceEncoder, default_encoder_path  # noqa: E402
from unmask.retrieval.index import NewChunk  # noqa: E402

from retrieval_code_set import load_code_set  # noqa: E402
from retrieval_conversations import evaluate_conversations  # noqa: E402

UNDERLINE = re.compile(r"^([=\-~^*+#\"'`])\1{2,}\s*$")
K = 5


def sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of an RST document's sections: a title line over a line of one repeated punctuation
    character at least as long (overlines are skipped)."""
    lines = text.splitlines()
    heads = [i for i in range(len(lines) - 1)
             if lines[i].strip() and not UNDERLINE.match(lines[i]) and UNDERLINE.match(lines[i + 1])
             and len(lines[i + 1].strip()) >= len(lines[i].strip())]
    out = []
    for n, i in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        body = "\n".join(line for line in lines[i + 2:end] if not UNDERLINE.match(line)).strip()
        out.append((lines[i].strip(), body))
    return out


def load_set() -> tuple[list[dict], list[dict]]:
    docs = []
    for split in ("heldout", "train"):
        for line in (ROOT / "data" / "corpus" / f"{split}.jsonl").open():
            d = json.loads(line)
            if d["source"] == "docs":
                docs += [{"id": f"{d['path']}#{n}", "title": t, "body": b, "heldout": split == "heldout"}
                         for n, (t, b) in enumerate(sections(d["text"])) if len(b) >= 200]
    counts = Counter(s["title"].lower() for s in docs)
    questions = [s for s in docs if s["heldout"] and len(s["title"].split()) >= 3 and counts[s["title"].lower()] == 1]
    return docs, questions


def open_backend(name: str, tmp: Path, dimension: int, pg, idf: bool = True):
    if name == "sqlite":
        from unmask.retrieval.sqlite_index import SQLiteIndex

        return SQLiteIndex(tmp / "chunks.db", dimension)
    import psycopg

    from unmask.retrieval.pg_index import PostgresIndex

    with psycopg.connect(pg.url, autocommit=True) as c:
        c.execute(f"DROP TABLE IF EXISTS unmask_chunks_{dimension}")
    return PostgresIndex(pg.url, dimension, idf=idf)


def evaluate(index, encoder, questions, store: str) -> dict:
    out = {}
    qvecs = encoder.encode_texts([q["title"] for q in questions]).vectors
    for mode in ("keyword", "vector", "hybrid"):
        hits, rr, times, ranks = 0, 0.0, [], []
        for q, v in zip(questions, qvecs):
            t = time.perf_counter()
            found = index.search([store], q["title"], v, 50, mode)
            times.append(time.perf_counter() - t)
            ranked = list(dict.fromkeys(h.file_id for h in found))
            rank = ranked.index(q["id"]) + 1 if q["id"] in ranked else 0
            ranks.append(rank)   # per question (0: not in the 50 results), for paired comparisons of runs
            if rank:
                hits += rank <= K
                rr += 1 / rank
        out[mode] = {"recall@5": hits / len(questions), "mrr": rr / len(questions),
                     "p50_ms": sorted(times)[len(times) // 2] * 1000, "ranks": ranks}
    return out


WORDS = re.compile(r"[a-z]{4,}")


def answers(index, encoder, questions, store: str, count: int, model: str) -> dict:
    """The built-in model's answers to `count` questions, with the file_search context (the top 3 hybrid results,
    in the server's format) and without. Support: the share of an answer's words (4+ letters) that occur in the
    gold section; a crude measure, reported with its baseline (no context) rather than as quality."""
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams
    from unmask.retrieval.file_search import FileSearch, fit

    llm = LLM(model, dtype="float32", device="cpu")
    params = GenerationParams(max_tokens=64, policy="threshold", threshold=0.9, temperature=0.0)
    support = {"without": [], "with": []}
    used: list[int] = []
    for q in questions[:count]:
        search = FileSearch({}, [store], 3, None, 0.0)
        hits = index.search([store], q["title"], encoder.encode_texts([q["title"]]).vectors[0], 3, "hybrid")
        search.results = [{"file_id": h.file_id, "filename": h.file_id, "text": h.text} for h in hits]
        gold = set(WORDS.findall(q["body"].lower()))
        question = [{"role": "user", "content": f"What does the Python documentation say about: {q['title']}?"}]
        # as the server does: the excerpts that fit the context beside the prompt and the answer's budget
        budget = llm.spec.max_context - len(llm.chat_prompt(question)) - params.max_tokens - 16
        context = fit(search, lambda text: len(llm.tokenizer.encode(text)), budget)
        used.append(search.used)
        for mode, system in (("without", None), ("with", context)):
            messages = ([{"role": "system", "content": system}] if system else []) + question
            text = llm.generate([llm.chat_prompt(messages)], params)[0].text
            words = WORDS.findall(text.lower())
            support[mode].append(sum(w in gold for w in words) / len(words) if words else 0.0)
    return {**{mode: sum(v) / len(v) for mode, v in support.items()}, "excerpts_given": sum(used) / len(used)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunking", action="append", help="MAX,OVERLAP tokens (repeatable; default 800,400)")
    ap.add_argument("--set", default="docs", choices=["docs", "code"], help="docs: section titles to sections "
                    "(above); code: docstring first lines to functions (bench/retrieval_code_set.py)")
    ap.add_argument("--no-conversations", action="store_true", help="skip the two-turn conversations "
                    "(bench/retrieval_conversations.py; hundreds of query embeddings, slow with a large embedder)")
    ap.add_argument("--backend", default="sqlite", choices=["sqlite", "postgres"])
    ap.add_argument("--pg-no-idf", action="store_true", help="Postgres keyword ranking without IDF weights (the "
                    "plain ts_rank_cd it had first)")
    ap.add_argument("--limit-docs", type=int, default=0, help="index only this many sections (0: all; a quick run)")
    ap.add_argument("--answers", type=int, default=0, help="also answer this many questions with the built-in model, "
                    "with and without the retrieved context (first chunking only)")
    ap.add_argument("--embedding-model", default=None, help="a sentence-transformers directory (default: the "
                    "packaged default embedder), as `unmask serve --embedding-model DIR` takes it")
    ap.add_argument("--model", default=str(ROOT / "src" / "unmask" / "assets" / "unmask-tiny"))
    args = ap.parse_args()
    if args.answers:   # imported first: the engine is needed only at the end
        import unmask.engine.llm  # noqa: F401
    if args.embedding_model:
        encoder = SentenceEncoder.load(Path(args.embedding_model))
    else:
        encoder = SentenceEncoder.load(default_encoder_path(), DEFAULT_ENCODER_NAME)
    print(f"embedder {encoder.name}: {encoder.dimension} dimensions, {encoder.spec.max_seq_length}-token window",
          flush=True)
    docs, questions = load_set() if args.set == "docs" else load_code_set(ROOT)
    if args.limit_docs:
        keep = {q["id"] for q in questions}
        docs = [d for d in docs if d["id"] in keep] + [d for d in docs if d["id"] not in keep][:args.limit_docs]
    print(f"{len(questions)} questions, {len(docs)} {'sections' if args.set == 'docs' else 'functions'} indexed",
          flush=True)
    pg = None
    if args.backend == "postgres":
        from pg_server import start_postgres

        pg = start_postgres()
    rows = []
    try:
        for spec in args.chunking or ["800,400"]:
            size, overlap = map(int, spec.split(","))
            tmp = Path(tempfile.mkdtemp(prefix="unmask-bench-"))
            index = open_backend(args.backend, tmp, encoder.dimension, pg, not args.pg_no_idf)
            t0, cpu0, n_chunks = time.perf_counter(), time.process_time(), 0
            for d in docs:
                _, spans = encoder.token_spans(d["body"])
                chunks = chunk_text(d["body"], spans, ChunkingStrategy(size, overlap))
                vectors = encoder.encode_texts([c.text for c in chunks]).vectors
                index.add("bench", d["id"], [NewChunk(c.index, c.text, v) for c, v in zip(chunks, vectors)])
                n_chunks += len(chunks)
            ingest = time.perf_counter() - t0
            # CPU seconds (all threads) measure the embedder's cost even when the machine's load starves the bench
            cpu_per_chunk = (time.process_time() - cpu0) / n_chunks
            load = os.getloadavg()[0]
            result = evaluate(index, encoder, questions, "bench")
            # file_search's query in two-turn conversations (on the documentation set, whose questions are topics)
            if args.set == "docs" and not args.no_conversations and spec == (args.chunking or ["800,400"])[0]:
                talks = evaluate_conversations(index, encoder, questions, "bench")
                rows.append({"chunking": spec, "backend": args.backend, "conversations": talks})
                for kind, by_strategy in talks.items():
                    print(f"conversation {kind:12s} " + "  ".join(
                        f"{strategy}: recall@5 {m['recall@5']:.3f} MRR {m['mrr']:.3f}"
                        for strategy, m in by_strategy.items()), flush=True)
            if args.answers and spec == (args.chunking or ["800,400"])[0]:
                support = answers(index, encoder, questions, "bench", args.answers, args.model)
                rows.append({"chunking": spec, "answers": args.answers, "support": support})
                print(f"answer support (share of answer words found in the gold section), {args.answers} questions: "
                      f"without file_search {support['without']:.3f}, with {support['with']:.3f} "
                      f"({support['excerpts_given']:.2f} of 3 excerpts fitted on average)", flush=True)
            index.close()
            shutil.rmtree(tmp, ignore_errors=True)
            for mode, m in result.items():
                rows.append({"chunking": spec, "backend": args.backend, "mode": mode, **m})
                print(f"{spec:>8s} {args.backend:8s} {mode:8s} recall@5 {m['recall@5']:.3f}  MRR {m['mrr']:.3f}  "
                      f"search p50 {m['p50_ms']:.1f} ms", flush=True)
            print(f"{spec:>8s} ingestion: {n_chunks} chunks in {ingest:.0f} s ({n_chunks / ingest:.1f} chunks/s, "
                  f"embedding included; {cpu_per_chunk * 1000:.1f} CPU ms per chunk; load average {load:.1f} at its "
                  "end)", flush=True)
            rows.append({"chunking": spec, "backend": args.backend, "chunks": n_chunks,
                         "ingest_chunks_per_s": n_chunks / ingest, "ingest_cpu_ms_per_chunk": cpu_per_chunk * 1000,
                         "load_average": load})
    finally:
        if pg is not None:
            pg.stop()
            shutil.rmtree(pg.root, ignore_errors=True)
    print(json.dumps({"bench": "retrieval", "set": args.set, "embedder": encoder.name, "questions": len(questions),
                      "sections": len(docs), "results": rows}))


if __name__ == "__main__":
    main()
