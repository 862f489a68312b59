"""file_search's query in a conversation: the last user message alone (what the server does) against also searching
with the user turn before it, the two rankings fused by reciprocal rank (k = 60).

Built from bench/retrieval.py's questions (a section title; the answer is that section), three kinds of
two-turn conversations, one per question:
- follow-up: "What does the Python documentation say about: <title>?", then a short follow-up that names no
  topic ("Can you give an example?", ...); the answer is the first turn's section;
- switch: a turn about another question's title, then the full question about this one; the answer is this one's;
- short switch: a turn about another question's title, then "And <the title's last two words>?"; this one's.

Strategies: `last` (the last user message), `short: fuse` (also the turn before when the last has fewer than
FOLLOW_UP_WORDS content words, in file_search's own sense of content words), `short+pronoun: fuse` (the same,
only when the last also has a pronoun that points back: it, that, they...), `always fuse`.
"""
from __future__ import annotations

import re

from unmask.retrieval.file_search import _content_words
from unmask.retrieval.index import fuse

FOLLOW_UP_WORDS = 3
FOLLOW_UPS = ["Can you give an example?", "Tell me more about it.", "Why is that?", "How do I use it?",
              "What are the exceptions?"]
STRATEGIES = ("last", "short: fuse", "short+pronoun: fuse", "always fuse")
ANAPHORA = frozenset("it its this that these those they them their".split())
K, POOL = 5, 50


def conversations(questions: list[dict]) -> dict[str, list[tuple[str, str, str]]]:
    """kind -> [(previous user turn, last user turn, the answer's section id)]."""
    ask = [f"What does the Python documentation say about: {q['title']}?" for q in questions]
    n = len(questions)
    return {
        "follow-up": [(ask[i], FOLLOW_UPS[i % len(FOLLOW_UPS)], q["id"]) for i, q in enumerate(questions)],
        "switch": [(ask[(i + 1) % n], ask[i], q["id"]) for i, q in enumerate(questions)],
        "short switch": [(ask[(i + 1) % n], f"And {' '.join(q['title'].split()[-2:])}?", q["id"])
                         for i, q in enumerate(questions)],
    }


def ranked_sections(index, encoder, store: str, queries: list[str]) -> list[str]:
    """Distinct sections, best first, of the hybrid search for each query, fused by reciprocal rank when several."""
    vectors = encoder.encode_texts(queries).vectors
    runs = [index.search([store], q, v, POOL, "hybrid") for q, v in zip(queries, vectors)]
    if len(runs) == 1:
        hits = runs[0]
    else:
        by_id = {h.chunk_id: h for run in runs for h in run}
        fused = fuse([[(h.chunk_id, h.score) for h in run] for run in runs])
        hits = [by_id[cid] for cid, _ in sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))]
    return list(dict.fromkeys(h.file_id for h in hits))


def queries_for(strategy: str, previous: str, last: str) -> list[str]:
    short = len(_content_words(last)) < FOLLOW_UP_WORDS
    pronoun = bool(ANAPHORA & set(re.findall(r"[a-z]+", last.lower())))
    if (strategy == "always fuse" or (strategy == "short: fuse" and short)
            or (strategy == "short+pronoun: fuse" and short and pronoun)):
        return [last, previous]
    return [last]


def evaluate_conversations(index, encoder, questions: list[dict], store: str) -> dict:
    """kind -> strategy -> recall@5, MRR and per-question ranks (0: not found)."""
    out: dict = {}
    for kind, convs in conversations(questions).items():
        out[kind] = {}
        for strategy in STRATEGIES:
            ranks = []
            for previous, last, gold in convs:
                ranked = ranked_sections(index, encoder, store, queries_for(strategy, previous, last))
                ranks.append(ranked.index(gold) + 1 if gold in ranked else 0)
            out[kind][strategy] = {"recall@5": sum(0 < r <= K for r in ranks) / len(ranks),
                                   "mrr": sum(1 / r for r in ranks if r) / len(ranks), "ranks": ranks}
    return out
