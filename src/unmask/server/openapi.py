"""The OpenAPI document at /openapi.json, made to say what the server really sends.

FastAPI's own document declares 200 (with an empty schema) and 422 for every route. This server answers
validation errors with 400 and every error in OpenAI's envelope, streams as `text/event-stream`, serves
`/metrics` as Prometheus text, and builds its JSON answers itself. `OPERATIONS` lists, per route and
method, the operation id (unique, as client generators need), the 200 body and the error statuses it can
answer; `install` replaces FastAPI's generator with one that applies the table. Statuses every route can
answer (401 with API keys set, except on the open paths; 413 over the body limit) are added to all.

Not declared: 405 (an undeclared method is no operation; the answer carries `Allow`) and 499 (logged and
counted for a non-streamed request whose client went away: no client is left to read it). 500 is never
meant to be sent; the fuzz target (tests/test_fuzz.py) checks that none is.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from unmask.server.protocol import (ERROR_TYPES, ChatCompletionResponse, CompletionResponse, DetokenizeResponse,
                                    EditCompletionResponse, ErrorResponse, ModelCard, ModelList, TokenizeResponse)
from unmask.retrieval.embeddings import EmbeddingResponse
from unmask.retrieval.protocol import (Deleted, FileBatchObject, SearchResultsPage, VectorStoreFileList,
                                       VectorStoreFileObject, VectorStoreList, VectorStoreObject)
from unmask.server.protocol_responses import ResponseObject
from unmask.server.security import OPEN_PATHS
from unmask.store.protocol import FileDeleted, FileList, FileObject
from unmask.batch.protocol import BatchList, BatchObject

REF = "#/components/schemas/{model}"
HEALTH = {"type": "object", "required": ["status"],
          "properties": {"status": {"type": "string", "enum": ["ok", "loading", "error"]}}}


@dataclass(frozen=True)
class Operation:
    operation_id: str
    body: type[BaseModel] | None     # the 200 JSON body
    errors: tuple[int, ...] = ()     # besides 401 and 413
    stream: bool = False             # with `stream: true` the 200 is text/event-stream
    text: bool = False               # the 200 is Prometheus text
    binary: bool = False             # the 200 is raw bytes (a file's content)
    summary: str = ""


# one server-sent event, as OpenAPI 3.2 models a text/event-stream item (and schemathesis checks each event):
# `data` is a JSON chunk or [DONE]; /v1/responses also types its events with `event:` lines
SSE_EVENT = {"type": "object", "description": "Server-sent events: `data:` lines (typed `event:` lines on /v1/responses)",
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer"}},
             "required": ["data"]}
GENERATE = (400, 404, 429, 503)      # generation routes: bad input, unknown model, queue full, loading / dead
RETRIEVAL = (400, 404, 503)          # embeddings and vector stores: bad input, unknown id, loading
VS = "/v1/vector_stores"
VS_ID = VS + "/{vector_store_id}"
VS_FILE = VS_ID + "/files/{file_id}"
VS_BATCH = VS_ID + "/file_batches/{batch_id}"
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/chat/completions", "post"): Operation("createChatCompletion", ChatCompletionResponse, GENERATE, True,
                                                summary="Chat completion, streamed or not"),
    ("/v1/completions", "post"): Operation("createCompletion", CompletionResponse, GENERATE, True,
                                           summary="Text completion; with suffix, fill in the middle"),
    ("/v1/fim/completions", "post"): Operation("createFimCompletion", CompletionResponse, GENERATE, True,
                                               summary="Fill in the middle"),
    ("/v1/apply/completions", "post"): Operation("createApplyCompletion", ChatCompletionResponse, GENERATE, True,
                                                 summary="Merge an update snippet into code"),
    ("/v1/edit/completions", "post"): Operation("createEditCompletion", EditCompletionResponse, GENERATE, True,
                                                summary="Next edit around the cursor"),
    ("/v1/responses", "post"): Operation("createResponse", ResponseObject, GENERATE, True,
                                         summary="Responses API (stateless)"),
    ("/v1/responses/{response_id}", "get"): Operation("getResponse", None, (404,),
                                                      summary="Always 404: nothing is stored"),
    ("/v1/responses/{response_id}", "post"): Operation("postResponse", None, (404,),
                                                       summary="Always 404 (.../cancel): nothing is stored"),
    ("/v1/responses/{response_id}", "delete"): Operation("deleteResponse", None, (404,),
                                                         summary="Always 404: nothing is stored"),
    ("/v1/models", "get"): Operation("listModels", ModelList, (503,), summary="The served model"),
    ("/v1/models/{model_id}", "get"): Operation("retrieveModel", ModelCard, (404, 503), summary="One model"),
    ("/tokenize", "post"): Operation("tokenize", TokenizeResponse, (400, 404, 503),
                                     summary="The token ids an endpoint feeds the model"),
    ("/detokenize", "post"): Operation("detokenize", DetokenizeResponse, (400, 404, 503), summary="Ids to text"),
    ("/health", "get"): Operation("getHealth", None, (503,), summary="200 ready, 503 loading or engine dead"),
    ("/health", "head"): Operation("headHealth", None, (503,), summary="Status code only"),
    ("/metrics", "get"): Operation("getMetrics", None, text=True, summary="Prometheus metrics"),
    ("/v1/embeddings", "post"): Operation("createEmbedding", EmbeddingResponse, (400, 404, 503),
                                          summary="Embed strings or token arrays"),
    # vector stores (unmask.retrieval): 404 for unknown ids (and with --embedding-model off), 503 while loading
    (VS, "post"): Operation("createVectorStore", VectorStoreObject, RETRIEVAL, summary="Create a vector store"),
    (VS, "get"): Operation("listVectorStores", VectorStoreList, RETRIEVAL, summary="Vector stores"),
    (VS_ID, "get"): Operation("getVectorStore", VectorStoreObject, RETRIEVAL, summary="One vector store"),
    (VS_ID, "post"): Operation("modifyVectorStore", VectorStoreObject, RETRIEVAL,
                               summary="Rename, set metadata or expiry"),
    (VS_ID, "delete"): Operation("deleteVectorStore", Deleted, RETRIEVAL,
                                 summary="Delete a vector store (not its files)"),
    (VS_ID + "/files", "post"): Operation("createVectorStoreFile", VectorStoreFileObject, RETRIEVAL,
                                          summary="Attach a file (ingested in the background)"),
    (VS_ID + "/files", "get"): Operation("listVectorStoreFiles", VectorStoreFileList, RETRIEVAL,
                                         summary="A vector store's files"),
    (VS_FILE, "get"): Operation("getVectorStoreFile", VectorStoreFileObject, RETRIEVAL, summary="One file's status"),
    (VS_FILE, "post"): Operation("updateVectorStoreFileAttributes", VectorStoreFileObject, RETRIEVAL,
                                 summary="Replace a file's attributes"),
    (VS_FILE, "delete"): Operation("deleteVectorStoreFile", Deleted, RETRIEVAL,
                                   summary="Detach a file (the file itself stays)"),
    (VS_ID + "/file_batches", "post"): Operation("createVectorStoreFileBatch", FileBatchObject, RETRIEVAL,
                                                 summary="Attach several files"),
    (VS_BATCH, "get"): Operation("getVectorStoreFileBatch", FileBatchObject, RETRIEVAL, summary="One batch's status"),
    (VS_BATCH + "/cancel", "post"): Operation("cancelVectorStoreFileBatch", FileBatchObject, RETRIEVAL,
                                              summary="Cancel the batch's files not yet done"),
    (VS_BATCH + "/files", "get"): Operation("listFilesInVectorStoreBatch", VectorStoreFileList, RETRIEVAL,
                                            summary="A batch's files"),
    (VS_ID + "/search", "post"): Operation("searchVectorStore", SearchResultsPage, RETRIEVAL,
                                           summary="Hybrid, keyword or vector search"),
    ("/v1/files", "post"): Operation("createFile", FileObject, (400,), summary="Upload a file (multipart/form-data)"),
    ("/v1/files", "get"): Operation("listFiles", FileList, (400, 404), summary="Files, newest first"),
    ("/v1/files/{file_id}", "get"): Operation("retrieveFile", FileObject, (404,), summary="One file's metadata"),
    ("/v1/files/{file_id}", "delete"): Operation("deleteFile", FileDeleted, (404,), summary="Delete a file"),
    ("/v1/files/{file_id}/content", "get"): Operation("downloadFile", None, (404,), binary=True,
                                                      summary="A file's bytes"),
    ("/v1/batches", "post"): Operation("createBatch", BatchObject, (400, 404), summary="Start a batch from a file"),
    ("/v1/batches", "get"): Operation("listBatches", BatchList, (400, 404), summary="Batches, newest first"),
    ("/v1/batches/{batch_id}", "get"): Operation("retrieveBatch", BatchObject, (404,), summary="One batch"),
    ("/v1/batches/{batch_id}/cancel", "post"): Operation("cancelBatch", BatchObject, (400, 404),
                                                         summary="Stop starting lines; keep the finished ones"),
}

ERROR_DESCRIPTIONS = {400: "Invalid request", 401: "Missing or invalid API key", 404: "Not found",
                      413: "Request body over --max-body-bytes (uploads: --max-file-bytes)", 429: "Server busy: retry after Retry-After seconds",
                      503: "Model loading, engine dead or shutting down"}
ERROR_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
    429: {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds to wait before retrying"}},
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ok(op: Operation, refs: dict[type[BaseModel], dict], path: str) -> dict[str, Any]:
    if op.text:
        return {"description": "Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}
    if op.binary:
        return {"description": "The file's bytes",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
    if path == "/health":
        return {"description": "Ready", "content": _json(HEALTH)}
    content = _json(refs[op.body] if op.body else {})
    if op.stream:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    return {"description": "Success (`text/event-stream` when the request sets `stream: true`)" if op.stream
            else "Success", "content": content}


def _error(status: int, path: str, envelope: dict) -> dict[str, Any]:
    if path == "/health" and status == 503:   # the probe's own shape, not the error envelope
        return {"description": "Loading, or the engine is dead", "content": _json(HEALTH)}
    out = {"description": f"{ERROR_DESCRIPTIONS[status]} (error type `{ERROR_TYPES[status]}`)",
           "content": _json(envelope)}
    if status in ERROR_HEADERS:
        out["headers"] = ERROR_HEADERS[status]
    return out


def build(app: FastAPI) -> dict[str, Any]:
    """The document: FastAPI's paths and request schemas, with the responses and ids of `OPERATIONS`."""
    with warnings.catch_warnings():   # FastAPI's own ids repeat on multi-method routes; replaced below
        warnings.filterwarnings("ignore", "Duplicate Operation ID")
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
    models = sorted({op.body for op in OPERATIONS.values() if op.body} | {ErrorResponse}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "serialization") for m in models], ref_template=REF)
    refs = {m: refs[(m, "serialization")] for m in models}
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):   # 422 is never sent (validation errors are 400)
        schemas.pop(name, None)
    for name, schema in defs.get("$defs", {}).items():
        if name in schemas and schemas[name] != schema:
            raise RuntimeError(f"OpenAPI schema name {name!r} is both a request and a response type")
        schemas[name] = schema
    seen: set[str] = set()
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            op = OPERATIONS.get((path, method)) or Operation(f"{operation['operationId']}_{method}", None, (400, 503))
            if op.operation_id in seen:
                raise RuntimeError(f"duplicate OpenAPI operation id {op.operation_id!r}")
            seen.add(op.operation_id)
            operation["operationId"] = op.operation_id
            if op.summary:
                operation["summary"] = op.summary
            statuses = sorted({*op.errors, 413} | ({401} if path not in OPEN_PATHS else set()))
            ok = {"200": _ok(op, refs, path)} if op.body or op.text or op.binary or path == "/health" else {}  # else never 200
            operation["responses"] = {**ok, **{str(s): _error(s, path, refs[ErrorResponse]) for s in statuses}}
    return doc


def install(app: FastAPI) -> None:
    """Serve `build(app)` (built once, on the first request for it) as /openapi.json."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi
