"""POST /v1/embeddings: OpenAI's request and response shapes over a `SentenceEncoder`.

Inputs are a string, a list of strings, a token array or a list of token arrays (ids of the embedding model's
own tokenizer; the model's special tokens are added around them, as around text). As on OpenAI, an input longer
than the model's window is a 400, not cut silently, and so is an empty one. `encoding_format: base64` is the
float32 little-endian bytes of each vector (what the openai client asks for by default and decodes with numpy).
"""
from __future__ import annotations

import base64
from typing import Literal

from pydantic import BaseModel

from unmask.retrieval.encoder import SentenceEncoder, normalize_rows
from unmask.server.protocol import APIError, RequestModel

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(RequestModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def _token_inputs(req: EmbeddingRequest, encoder: SentenceEncoder) -> list[list[int]]:
    raw = req.input
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise APIError(400, "input must not be empty", param="input")
    if all(isinstance(x, int) for x in raw):   # one token array
        raw = [raw]
    if len(raw) > MAX_INPUTS:
        raise APIError(400, f"input has {len(raw)} items; at most {MAX_INPUTS} per request", param="input")
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"input[{i}] is an empty string", param="input")
            ids = encoder.tokenize(item)
        else:
            if not item:
                raise APIError(400, f"input[{i}] is an empty token array", param="input")
            bad = next((t for t in item if not 0 <= t < encoder.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"input[{i}] holds token id {bad}, outside the model's vocabulary "
                                    f"(0-{encoder.vocab_size - 1})", param="input")
            ids = item
        if len(ids) > encoder.max_content_tokens:
            raise APIError(400, f"input[{i}] is {len(ids)} tokens; this model reads at most "
                                f"{encoder.max_content_tokens}", param="input", code="context_length_exceeded")
        out.append(ids)
    return out


def check_dimensions(dimensions: int | None, encoder: SentenceEncoder) -> int:
    native = encoder.dimension
    if dimensions is None or dimensions == native:
        return native
    if not encoder.spec.matryoshka:
        raise APIError(400, f"model {encoder.name!r} does not support `dimensions` other than its own {native} "
                            "(it was not trained to be truncated)", param="dimensions")
    if not 1 <= dimensions <= native:
        raise APIError(400, f"dimensions must be between 1 and {native}, got {dimensions}", param="dimensions")
    return dimensions


def embed(req: EmbeddingRequest, encoder: SentenceEncoder) -> EmbeddingResponse:
    """Runs the model: call it off the event loop."""
    if req.model != encoder.name:
        raise APIError(404, f"embedding model {req.model!r} does not exist; this server embeds with {encoder.name!r}",
                       param="model", code="model_not_found")
    dims = check_dimensions(req.dimensions, encoder)
    inputs = _token_inputs(req, encoder)
    result = encoder.encode_ids(inputs)
    vectors = result.vectors
    if dims != encoder.dimension:   # Matryoshka: the leading dimensions, renormalised if the model normalises
        vectors = vectors[:, :dims]
        if encoder.spec.normalize:
            vectors = normalize_rows(vectors)
    if req.encoding_format == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        data = [v.tolist() for v in vectors]
    tokens = sum(result.token_counts)
    return EmbeddingResponse(data=[Embedding(index=i, embedding=d) for i, d in enumerate(data)], model=encoder.name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
