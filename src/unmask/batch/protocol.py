"""Wire types of the Batch API (OpenAI's shapes)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, field_validator

from unmask.batch.lines import ENDPOINTS
from unmask.server.protocol import RequestModel

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
assert set(Endpoint.__args__) == set(ENDPOINTS)
Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                 "cancelled"]


class BatchCreateRequest(RequestModel):
    input_file_id: str
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:   # OpenAI's limits on metadata
            if len(v) > 16:
                raise ValueError(f"metadata takes at most 16 keys, got {len(v)}")
            for key, value in v.items():
                if len(key) > 64 or len(value) > 512:
                    raise ValueError(f"metadata key {key[:64]!r}: keys are at most 64 characters, values 512")
        return v


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None
    usage: BatchUsage | None = None   # once the batch has finished


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
