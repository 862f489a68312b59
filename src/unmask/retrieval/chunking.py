"""Chunking strategies of OpenAI's vector stores, on the embedding model's tokenizer.

`auto` is 800 tokens with 400 of overlap (OpenAI's documented default); `static` takes `max_chunk_size_tokens`
(100-4096) and `chunk_overlap_tokens` (at least 0, at most half the chunk size), OpenAI's bounds. A chunk is the
original text between its first token's start and its last token's end, so no character is lost or rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUTO_MAX_TOKENS, AUTO_OVERLAP = 800, 400
MIN_CHUNK, MAX_CHUNK = 100, 4096


class ChunkingError(ValueError):
    """A chunking_strategy the API refuses; the message names the field."""

    def __init__(self, message: str, param: str = "chunking_strategy"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChunkingStrategy:
    max_tokens: int = AUTO_MAX_TOKENS
    overlap: int = AUTO_OVERLAP
    auto: bool = True

    def to_api(self) -> dict[str, Any]:
        """The object OpenAI returns on a vector store file (`auto` is reported as the static values it means)."""
        return {"type": "static", "static": {"max_chunk_size_tokens": self.max_tokens,
                                             "chunk_overlap_tokens": self.overlap}}


def parse_strategy(raw: Any) -> ChunkingStrategy:
    """A request's `chunking_strategy` (None: auto)."""
    if raw is None:
        return ChunkingStrategy()
    if not isinstance(raw, dict) or raw.get("type") not in ("auto", "static"):
        raise ChunkingError("chunking_strategy.type must be 'auto' or 'static'", "chunking_strategy.type")
    if raw["type"] == "auto":
        return ChunkingStrategy()
    static = raw.get("static")
    if not isinstance(static, dict):
        raise ChunkingError("chunking_strategy.static is required when type is 'static'", "chunking_strategy.static")
    size, overlap = static.get("max_chunk_size_tokens"), static.get("chunk_overlap_tokens")
    for name, value in (("max_chunk_size_tokens", size), ("chunk_overlap_tokens", overlap)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ChunkingError(f"chunking_strategy.static.{name} must be an integer",
                                f"chunking_strategy.static.{name}")
    if not MIN_CHUNK <= size <= MAX_CHUNK:
        raise ChunkingError(f"max_chunk_size_tokens must be between {MIN_CHUNK} and {MAX_CHUNK}, got {size}",
                            "chunking_strategy.static.max_chunk_size_tokens")
    if not 0 <= overlap <= size // 2:
        raise ChunkingError(f"chunk_overlap_tokens must be between 0 and half of max_chunk_size_tokens "
                            f"({size // 2}), got {overlap}", "chunking_strategy.static.chunk_overlap_tokens")
    return ChunkingStrategy(size, overlap, auto=False)


@dataclass(frozen=True)
class Chunk:
    index: int
    text: str
    start: int      # character offsets in the document
    end: int
    tokens: int


def chunk_text(text: str, spans: list[tuple[int, int]], strategy: ChunkingStrategy) -> list[Chunk]:
    """Windows of `strategy.max_tokens` tokens, each starting `max_tokens - overlap` tokens after the last.
    `spans` are the tokens' character offsets in `text` (the tokenizer's)."""
    chunks: list[Chunk] = []
    step = strategy.max_tokens - strategy.overlap
    first = 0
    while first < len(spans):
        last = min(first + strategy.max_tokens, len(spans))
        start, end = spans[first][0], spans[last - 1][1]
        chunks.append(Chunk(len(chunks), text[start:end], start, end, last - first))
        if last == len(spans):
            break
        first += step
    return chunks
