"""The Files API (OpenAI's shapes): upload, list, retrieve, content, delete. Routes only; the store is files.py.

The store is `request.app.state.store` (a LazyStore); uploads are multipart/form-data with the fields `file`
and `purpose`, parsed here rather than by FastAPI's form parameters so that every bad upload is a 400 in the
error envelope that says what to send.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import UploadFile

from unmask.server.protocol import APIError
from unmask.store import FileNotFound, FileTooLargeError, Store
from unmask.store.files import LIST_LIMIT_MAX, UPLOAD_PURPOSES

router = APIRouter()
MULTIPART_OVERHEAD = 64 * 1024   # room for the form's other fields and part headers over --max-file-bytes
T = TypeVar("T")


def body_limits(max_file_bytes: int) -> dict[str, tuple[int, str]]:
    """The body size limit of the upload route, for BodyLimitMiddleware: the file limit, not --max-body-bytes."""
    return {"/v1/files": (max_file_bytes + MULTIPART_OVERHEAD,
                          f"the file is larger than this server's limit of {max_file_bytes} bytes (--max-file-bytes)")}


def store_of(request: Request) -> Store:
    return request.app.state.store.get()


def not_found(e: FileNotFound, param: str = "file_id") -> APIError:
    return APIError(404, str(e), param=param, code="file_not_found")


def found(call: Callable[[], T], param: str = "file_id") -> T:
    try:
        return call()
    except FileNotFound as e:
        raise not_found(e, param) from None


# declared by hand (the route parses its form itself): clients and the fuzz target see the form's fields
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)}}}}}}}


@router.post("/v1/files", openapi_extra=UPLOAD_BODY)
async def upload_file(request: Request) -> JSONResponse:
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise APIError(400, f"upload the file as multipart/form-data with the fields `file` and `purpose` "
                            f"(got Content-Type {ctype or 'none'!r})", code="invalid_content_type")
    try:
        form = await request.form(max_files=1, max_fields=16)
    except Exception as e:  # noqa: BLE001 - any parse failure of the client's body is its 400
        raise APIError(400, f"the multipart body does not parse: {getattr(e, 'detail', e)}", param="file") from None
    try:
        purpose, upload = form.get("purpose"), form.get("file")
        if not isinstance(purpose, str) or not purpose:
            raise APIError(400, "the form field `purpose` is missing", param="purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"purpose {purpose!r} is not supported here; use one of {', '.join(UPLOAD_PURPOSES)}",
                           param="purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "the form field `file` is missing or is not a file part (send it with a filename)",
                           param="file")
        store = store_of(request)
        try:
            stored = await asyncio.to_thread(store.files.create, upload.file, upload.filename or "file", purpose)
        except FileTooLargeError as e:
            raise APIError(413, str(e), param="file", code="file_too_large") from None
    finally:
        await form.close()
    return JSONResponse(stored.to_api())


@router.get("/v1/files")
def list_files(request: Request, purpose: str | None = None, limit: int = Query(LIST_LIMIT_MAX, ge=1, le=LIST_LIMIT_MAX),
               after: str | None = None, order: str = "desc") -> JSONResponse:
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    files, has_more = found(lambda: store_of(request).files.list(purpose, limit, after, order), "after")
    data = [f.to_api() for f in files]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@router.get("/v1/files/{file_id}")
def retrieve_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse(found(lambda: store_of(request).files.get(file_id)).to_api())


@router.get("/v1/files/{file_id}/content")
def file_content(file_id: str, request: Request) -> StreamingResponse:
    # opened before answering: a delete from here on does not cut the stream short (contents.py)
    stored, download = found(lambda: store_of(request).files.stream(file_id))
    return StreamingResponse(iter(download), media_type="application/octet-stream",
                             headers={"Content-Length": str(stored.bytes)}, background=BackgroundTask(download.close))


@router.delete("/v1/files/{file_id}")
def delete_file(file_id: str, request: Request) -> JSONResponse:
    stored = found(lambda: store_of(request).files.delete(file_id))
    return JSONResponse({"id": stored.id, "object": "file", "deleted": True})
