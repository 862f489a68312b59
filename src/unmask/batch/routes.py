"""The Batch API routes: create, retrieve, list, cancel. The work is runner.py's; the state is jobs.py's."""
from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from unmask.batch.jobs import BatchJobs, BatchNotFound
from unmask.batch.protocol import BatchCreateRequest
from unmask.server.protocol import APIError
from unmask.store import FileNotFound

router = APIRouter()


def jobs_of(request: Request) -> BatchJobs:
    return BatchJobs(request.app.state.store.get().db)


def not_found(e: BatchNotFound, param: str = "batch_id") -> APIError:
    return APIError(404, str(e), param=param, code="batch_not_found")


@router.post("/v1/batches")
def create_batch(body: BatchCreateRequest, request: Request) -> JSONResponse:
    store = request.app.state.store.get()
    try:
        file = store.files.get(body.input_file_id)
    except FileNotFound as e:
        raise APIError(404, str(e), param="input_file_id", code="file_not_found") from None
    if file.purpose != "batch":
        raise APIError(400, f"input file {file.id!r} has purpose {file.purpose!r}; a batch's input file must be "
                            "uploaded with purpose 'batch'", param="input_file_id")
    batch = BatchJobs(store.db).create(body.input_file_id, body.endpoint, body.completion_window, body.metadata,
                                       None)
    request.app.state.batches.notify_threadsafe()
    return JSONResponse(batch)


@router.get("/v1/batches")
def list_batches(request: Request, after: str | None = None,
                 limit: int = Query(20, ge=1, le=100)) -> JSONResponse:
    try:
        data, has_more = jobs_of(request).list(limit, after)
    except BatchNotFound as e:
        raise not_found(e, "after") from None
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@router.get("/v1/batches/{batch_id}")
def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    try:
        return JSONResponse(jobs_of(request).get(batch_id))
    except BatchNotFound as e:
        raise not_found(e) from None


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    try:   # on the event loop, where the runner's in-flight lines can be cancelled at once
        batch = request.app.state.batches.cancel(batch_id)
    except BatchNotFound as e:
        raise not_found(e) from None
    if batch["status"] not in ("cancelling", "cancelled"):
        raise APIError(400, f"batch {batch_id!r} is {batch['status']}; only a validating or in-progress batch can "
                            "be cancelled", param="batch_id", code="batch_not_cancellable")
    return JSONResponse(batch)
