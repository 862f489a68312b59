"""The `file_search` tool of /v1/responses: retrieval done by the server before the model writes.

`tools: [{"type": "file_search", "vector_store_ids": [...], "max_num_results": N, "filters": ...,
"ranking_options": {"score_threshold": ...}}]`. The query is the text of the last user message (this model is not
trained to write search queries, so the server does not ask it for one). The results go into the system
instructions as numbered excerpts, best first, as many as fit the model's context next to the prompt and the
answer's token budget; the answer then carries one `file_search_call` output item (its `results` when
`include` names `file_search_call.results`) before the message, and the message's text one `file_citation`
annotation per file whose excerpts the model was given.
"""
from __future__ import annotations

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

    def annotations(self, text_length: int) -> list[dict]:
        """One file_citation per file given to the model, at the end of the text (the model cites no spans)."""
        seen: dict[str, str] = {}
        for r in self.results[:self.used]:
            seen.setdefault(r["file_id"], r["filename"])
        return [{"type": "file_citation", "index": text_length, "file_id": fid, "filename": name}
                for fid, name in seen.items()]


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

