"""Routes of /v1/vector_stores (OpenAI's shapes); the work is in vector_stores.py.

Until the embedding model has loaded they answer 503 (so does /health); with `--embedding-model off` there are
no vector stores (404). Requests are checked before anything is stored: an unknown file is a 404, a file type
that cannot be searched or bytes that are not UTF-8 a 400 naming the file.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from unmask.retrieval.chunking import ChunkingError, parse_strategy
from unmask.retrieval.extract import ExtractError, extract_text
from unmask.retrieval.filters import FilterError, check_attributes, check_filter
from unmask.retrieval.protocol import (AttachFile, CreateFileBatch, CreateVectorStore, Deleted, FileBatchObject,
                                       ModifyVectorStore, SearchRequest, SearchResult, SearchResultsPage,
                                       UpdateFileAttributes, VectorStoreFileList, VectorStoreFileObject,
                                       VectorStoreList, VectorStoreObject)
from unmask.retrieval.vector_stores import Attach, NotFound, VectorStores
from unmask.server.protocol import APIError
from unmask.store import FileNotFound

router = APIRouter()
T = TypeVar("T")
Order = Literal["asc", "desc"]
MAX_RESULTS = 50


def service(request: Request) -> VectorStores:
    state = request.app.state.retrieval
    if state.encoder_path is None:
        raise APIError(404, "vector stores need an embedding model; this server was started with "
                            "--embedding-model off", code="not_found")
    if state.vector_stores is None:
        if state.load_error:
            raise APIError(503, f"vector stores are unavailable: {state.load_error}", code="model_load_failed")
        state.check_store()   # their database does not answer yet: 503 store_unavailable
        raise APIError(503, "the embedding model is still loading; retry shortly", code="model_loading")
    return state.vector_stores


async def call(fn: Callable[..., T], *args) -> T:
    """Run a (blocking) service call in a thread, mapping its errors to the API's."""
    try:
        return await asyncio.to_thread(fn, *args)
    except NotFound as e:
        raise APIError(404, str(e), param=e.param, code="not_found") from None
    except FileNotFound as e:
        raise APIError(404, str(e), param="file_id", code="file_not_found") from None
    except (ChunkingError, FilterError) as e:
        raise APIError(400, str(e), param=e.param) from None
    except ExtractError as e:
        raise APIError(400, str(e), param="file_id", code=e.code) from None


def ok(model: type[BaseModel], data: dict) -> Response:
    return Response(model.model_validate(data).model_dump_json(), media_type="application/json")


def listing(model: type[BaseModel], items: list[dict], more: bool) -> Response:
    return ok(model, {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                      "last_id": items[-1]["id"] if items else None, "has_more": more})


def _attach(vs: VectorStores, file_id: str, attributes, chunking) -> Attach:
    """Check one file to attach: it exists, its type is searchable, its text decodes; attributes and chunking."""
    stored = vs.files.get(file_id)
    extract_text(stored.filename, vs.files.read_bytes(file_id))
    return Attach(file_id, stored.filename, check_attributes(attributes), parse_strategy(chunking))


# ---------------------------------------------------------------------------------------- stores
@router.post("/v1/vector_stores")
async def create_vector_store(body: CreateVectorStore, request: Request) -> Response:
    vs = service(request)

    def create():
        attach = [_attach(vs, f, None, body.chunking_strategy) for f in dict.fromkeys(body.file_ids)]
        parse_strategy(body.chunking_strategy)
        expires = body.expires_after.model_dump() if body.expires_after else None
        return vs.create_store(body.name, body.metadata or {}, expires, attach)

    return ok(VectorStoreObject, await call(create))


@router.get("/v1/vector_stores")
async def list_vector_stores(request: Request, limit: int = Query(20, ge=1, le=100), order: Order = "desc",
                             after: str | None = None, before: str | None = None) -> Response:
    items, more = await call(service(request).list_stores, limit, order, after, before)
    return listing(VectorStoreList, items, more)


@router.get("/v1/vector_stores/{vector_store_id}")
async def retrieve_vector_store(vector_store_id: str, request: Request) -> Response:
    return ok(VectorStoreObject, await call(service(request).store, vector_store_id))


@router.post("/v1/vector_stores/{vector_store_id}")
async def modify_vector_store(vector_store_id: str, body: ModifyVectorStore, request: Request) -> Response:
    changes = body.model_dump(exclude_unset=True, exclude={"expires_after"})
    if "expires_after" in body.model_fields_set:
        changes["expires_after"] = body.expires_after.model_dump() if body.expires_after else None
    return ok(VectorStoreObject, await call(service(request).modify_store, vector_store_id, changes))


@router.delete("/v1/vector_stores/{vector_store_id}")
async def delete_vector_store(vector_store_id: str, request: Request) -> Response:
    await call(service(request).delete_store, vector_store_id)
    return ok(Deleted, {"id": vector_store_id, "object": "vector_store.deleted"})


# ---------------------------------------------------------------------------------------- files
@router.post("/v1/vector_stores/{vector_store_id}/files")
async def attach_file(vector_store_id: str, body: AttachFile, request: Request) -> Response:
    vs = service(request)

    def attach():
        vs.store(vector_store_id)   # 404 for an unknown store before the file is read
        return vs.attach(vector_store_id, _attach(vs, body.file_id, body.attributes, body.chunking_strategy))

    return ok(VectorStoreFileObject, await call(attach))


@router.get("/v1/vector_stores/{vector_store_id}/files")
async def list_files(vector_store_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                     order: Order = "desc", after: str | None = None, before: str | None = None,
                     filter: Literal["in_progress", "completed", "failed", "cancelled"] | None = None) -> Response:
    items, more = await call(service(request).list_files, vector_store_id, limit, order, after, before, filter)
    return listing(VectorStoreFileList, items, more)


@router.get("/v1/vector_stores/{vector_store_id}/files/{file_id}")
async def retrieve_file(vector_store_id: str, file_id: str, request: Request) -> Response:
    return ok(VectorStoreFileObject, await call(service(request).file, vector_store_id, file_id))


@router.post("/v1/vector_stores/{vector_store_id}/files/{file_id}")
async def update_file(vector_store_id: str, file_id: str, body: UpdateFileAttributes, request: Request) -> Response:
    vs = service(request)
    return ok(VectorStoreFileObject, await call(lambda: vs.update_attributes(
        vector_store_id, file_id, check_attributes(body.attributes))))


@router.delete("/v1/vector_stores/{vector_store_id}/files/{file_id}")
async def detach_file(vector_store_id: str, file_id: str, request: Request) -> Response:
    await call(service(request).detach, vector_store_id, file_id)
    return ok(Deleted, {"id": file_id, "object": "vector_store.file.deleted"})


# ---------------------------------------------------------------------------------------- batches
@router.post("/v1/vector_stores/{vector_store_id}/file_batches")
async def create_file_batch(vector_store_id: str, body: CreateFileBatch, request: Request) -> Response:
    vs = service(request)
    if bool(body.file_ids) == bool(body.files):
        raise APIError(400, "give either file_ids or files (a non-empty list)", param="file_ids")

    def create():
        vs.store(vector_store_id)
        if body.file_ids:
            attach = [_attach(vs, f, body.attributes, body.chunking_strategy) for f in dict.fromkeys(body.file_ids)]
        else:
            attach = [_attach(vs, f.file_id, f.attributes if f.attributes is not None else body.attributes,
                              f.chunking_strategy or body.chunking_strategy) for f in body.files]
        return vs.create_batch(vector_store_id, attach)

    return ok(FileBatchObject, await call(create))


@router.get("/v1/vector_stores/{vector_store_id}/file_batches/{batch_id}")
async def retrieve_file_batch(vector_store_id: str, batch_id: str, request: Request) -> Response:
    return ok(FileBatchObject, await call(service(request).batch, vector_store_id, batch_id))


@router.post("/v1/vector_stores/{vector_store_id}/file_batches/{batch_id}/cancel")
async def cancel_file_batch(vector_store_id: str, batch_id: str, request: Request) -> Response:
    return ok(FileBatchObject, await call(service(request).cancel_batch, vector_store_id, batch_id))


@router.get("/v1/vector_stores/{vector_store_id}/file_batches/{batch_id}/files")
async def list_batch_files(vector_store_id: str, batch_id: str, request: Request,
                           limit: int = Query(20, ge=1, le=100), order: Order = "desc", after: str | None = None,
                           before: str | None = None,
                           filter: Literal["in_progress", "completed", "failed", "cancelled"] | None = None):
    vs = service(request)
    await call(vs.batch, vector_store_id, batch_id)
    items, more = await call(vs.list_files, vector_store_id, limit, order, after, before, filter, batch_id)
    return listing(VectorStoreFileList, items, more)


# ---------------------------------------------------------------------------------------- search
@router.post("/v1/vector_stores/{vector_store_id}/search")
async def search(vector_store_id: str, body: SearchRequest, request: Request) -> Response:
    vs = service(request)
    queries = [body.query] if isinstance(body.query, str) else body.query
    if not queries or not any(q.strip() for q in queries):
        raise APIError(400, "query must not be empty", param="query")
    if not 1 <= body.max_num_results <= MAX_RESULTS:
        raise APIError(400, f"max_num_results must be between 1 and {MAX_RESULTS}, got {body.max_num_results}",
                       param="max_num_results")
    if body.filters is not None:
        try:
            check_filter(body.filters)
        except FilterError as e:
            raise APIError(400, str(e), param=e.param) from None
    threshold = body.ranking_options.score_threshold if body.ranking_options else 0.0
    if not 0 <= threshold <= 1:
        raise APIError(400, f"ranking_options.score_threshold must be between 0 and 1, got {threshold}",
                       param="ranking_options.score_threshold")
    hits = await call(vs.search, [vector_store_id], " ".join(queries), body.max_num_results, body.search_mode,
                      body.filters, threshold)
    data = [SearchResult(file_id=h.file_id, filename=name, score=h.score, attributes=attrs,
                         content=[{"type": "text", "text": h.text}]) for h, attrs, name in hits]
    return ok(SearchResultsPage, {"search_query": queries, "data": [d.model_dump() for d in data]})
