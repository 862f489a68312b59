"""The `file_search` tool of /v1/responses: retrieval done by the server before the model writes.

`tools: [{"type": "file_search", "vector_store_ids": [...], "max_num_results": N, "filters": ...,
"ranking_options": {"score_threshold": ...}}]`. The query is the text of the last user message (this model is not
trained to write search queries, so the server does not ask it for one). The results go into the system
instructions as numbered excerpts, best first, as many as fit the model's context next to the prompt and the
answer's token budget; the answer then carries one `file_search_call` output item (its `results` when
`include` names `file_search_call.results`) before the message, and the message's text one `file_citation`
annotation per file whose excerpts the model was given: at the end of each sentence that shares enough words
with one of that file's excerpts (`cite_spans`), else at the end of the text.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from unmask.retrieval.filters import FilterError, check_filter
from unmask.server.protocol import APIError

INCLUDE_RESULTS = "file_search_call.results"
DEFAULT_RESULTS, MAX_RESULTS = 10, 50
HEADER = ("Excerpts from the user's files, found by searching them for the user's question. Use them to answer "
          "when they are relevant, and say which file the answer comes from.")


@dataclass
class FileSearch:
    tool: dict[str, Any]
    store_ids: list[str]
    max_results: int
    filters: dict | None
    threshold: float
    query: str = ""
    results: list[dict] = field(default_factory=list)   # every result found, best first
    used: int = 0                                        # how many of them the prompt holds
    call_id: str = field(default_factory=lambda: "fs_" + secrets.token_hex(12))

    # ------------------------------------------------------------------ prompt
    def context(self, count: int) -> str:
        blocks = [f"[{i + 1}] {r['filename']} ({r['file_id']}):\n{r['text']}"
                  for i, r in enumerate(self.results[:count])]
        return HEADER + "\n\n" + "\n\n".join(blocks) if blocks else ""

    # ------------------------------------------------------------------ output
    def item(self, include_results: bool, status: str = "completed") -> dict:
        results = None
        if include_results and status == "completed":
            results = [{k: r[k] for k in ("file_id", "filename", "score", "text", "attributes")} for r in self.results]
        return {"id": self.call_id, "type": "file_search_call", "status": status, "queries": [self.query],
                "results": results}

    def annotations(self, text: str) -> list[dict]:
        """file_citations for the answer `text`: each file given to the model at the end of the sentences its
        excerpts support (cite_spans), and every file given that supports none at the end of the text, as
        before; ordered by position, then by the file's rank."""
        given = self.results[:self.used]
        names: dict[str, str] = {}
        for r in given:
            names.setdefault(r["file_id"], r["filename"])
        rank = {fid: i for i, fid in enumerate(names)}
        notes = cite_spans(text, given)
        cited = {fid for _, fid in notes}
        notes += [(len(text), fid) for fid in names if fid not in cited]
        notes = sorted(set(notes), key=lambda n: (n[0], rank[n[1]]))
        return [{"type": "file_citation", "index": i, "file_id": fid, "filename": names[fid]} for i, fid in notes]


# the model cites nothing itself, so a sentence is attributed by the words it shares with an excerpt: content words
# (3+ letters or digits, not among the commonest English words), at least MIN_SHARED of them and at least
# MIN_SHARE of the sentence's own
_WORD = re.compile(r"[A-Za-z0-9_]{3,}")
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)", re.M)
_COMMON = frozenset("""the and for are but not you all any can had her was one our out day get has him his how man
new now old see two way who boy did its let put say she too use that with have this will your from they know want
been good much some time very when come here just like long make many more only over such take than them well were
what which their there would about could other into then these those also each used using uses returns
return""".split())
MIN_SHARED, MIN_SHARE = 2, 0.4


def _content_words(text: str) -> set[str]:
    return {w for w in (m.lower() for m in _WORD.findall(text)) if w not in _COMMON}


def cite_spans(text: str, results: list[dict]) -> list[tuple[int, str]]:
    """(index just past the sentence, file id) for each sentence of `text` whose content words overlap one
    result's text enough; the file of the result with the largest overlap (the better-ranked on a tie)."""
    vocab = [(_content_words(r["text"]), r["file_id"]) for r in results]
    out = []
    for m in _SENTENCE.finditer(text):
        words = _content_words(m.group())
        if len(words) < MIN_SHARED:
            continue
        shared = [len(words & v) for v, _ in vocab]
        best = max(range(len(vocab)), key=lambda i: (shared[i], -i), default=None)
        if best is not None and shared[best] >= max(MIN_SHARED, MIN_SHARE * len(words)):
            out.append((m.start() + len(m.group().rstrip()), vocab[best][1]))
    return out


def split_tools(tools: list[dict] | None) -> tuple[list[dict] | None, FileSearch | None]:
    """(the other tools, or None when none is left; the file_search tool, checked)."""
    if not tools:
        return tools, None
    rest, found = [], None
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "file_search":
            rest.append(tool)
            continue
        if found is not None:
            raise APIError(400, "at most one file_search tool per request", param=f"tools[{i}]")
        ids = tool.get("vector_store_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(x, str) for x in ids):
            raise APIError(400, f"tools[{i}].vector_store_ids must be a non-empty list of ids",
                           param=f"tools[{i}].vector_store_ids")
        n = tool.get("max_num_results", DEFAULT_RESULTS)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_RESULTS:
            raise APIError(400, f"tools[{i}].max_num_results must be between 1 and {MAX_RESULTS}",
                           param=f"tools[{i}].max_num_results")
        filters = tool.get("filters")
        if filters is not None:
            try:
                check_filter(filters, f"tools[{i}].filters")
            except FilterError as e:
                raise APIError(400, str(e), param=e.param) from None
        threshold = (tool.get("ranking_options") or {}).get("score_threshold", 0.0)
        if not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise APIError(400, f"tools[{i}].ranking_options.score_threshold must be between 0 and 1",
                           param=f"tools[{i}].ranking_options.score_threshold")
        found = FileSearch(tool, list(dict.fromkeys(ids)), n, filters, float(threshold))
    return (rest or None), found


def last_user_text(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return ""


async def run(search: FileSearch, retrieval_state, messages: list[dict]) -> None:
    """Search the stores for the last user message; results land on `search`."""
    from unmask.retrieval.vector_store_routes import call

    vs = getattr(retrieval_state, "vector_stores", None)
    if vs is None:
        if retrieval_state is not None:
            retrieval_state.check_store()   # their database does not answer yet: 503 store_unavailable
        raise APIError(503 if getattr(retrieval_state, "encoder_path", None) else 400,
                       "file_search needs vector stores, which are not available on this server yet"
                       if getattr(retrieval_state, "encoder_path", None) else
                       "file_search needs vector stores; this server was started with --embedding-model off",
                       param="tools")
    search.query = last_user_text(messages)
    if not search.query.strip():
        return
    hits = await call(vs.search, search.store_ids, search.query, search.max_results, "hybrid", search.filters,
                      search.threshold)
    search.results = [{"file_id": h.file_id, "filename": name, "score": h.score, "text": h.text,
                       "attributes": attrs} for h, attrs, name in hits]


def fit(search: FileSearch, prompt_tokens, budget: int) -> str:
    """The longest prefix of the results whose context fits in `budget` tokens (`prompt_tokens(text)` counts);
    records how many it holds."""
    count = len(search.results)
    while count and prompt_tokens(search.context(count)) > budget:
        count -= 1
    search.used = count
    return search.context(count)

