"""Wire types of the vector stores API (OpenAI's shapes): requests checked here, answers built through the
response models so that what is sent is what /openapi.json declares."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from unmask.server.protocol import RequestModel

Scalar = str | int | float | bool


class ExpiresAfter(RequestModel):
    anchor: Literal["last_active_at"]
    days: int = Field(ge=1, le=365)   # OpenAI's bounds


class CreateVectorStore(RequestModel):
    name: str | None = None
    file_ids: list[str] = []
    expires_after: ExpiresAfter | None = None
    chunking_strategy: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None


class ModifyVectorStore(RequestModel):
    name: str | None = None
    expires_after: ExpiresAfter | None = None
    metadata: dict[str, str] | None = None


class AttachFile(RequestModel):
    file_id: str
    attributes: dict[str, Scalar] | None = None
    chunking_strategy: dict[str, Any] | None = None


class UpdateFileAttributes(RequestModel):
    attributes: dict[str, Scalar] | None


class BatchFile(RequestModel):
    file_id: str
    attributes: dict[str, Scalar] | None = None
    chunking_strategy: dict[str, Any] | None = None


class CreateFileBatch(RequestModel):
    file_ids: list[str] | None = None
    files: list[BatchFile] | None = None
    attributes: dict[str, Scalar] | None = None
    chunking_strategy: dict[str, Any] | None = None


class RankingOptions(RequestModel):
    ranker: Literal["auto", "default-2024-11-15", "none"] | None = None
    score_threshold: float = 0.0


class SearchRequest(RequestModel):
    query: str | list[str]
    filters: dict[str, Any] | None = None
    max_num_results: int = 10
    ranking_options: RankingOptions | None = None
    rewrite_query: bool = False
    # unmask's extension: the ranking alone or fused (docs/retrieval.md)
    search_mode: Literal["hybrid", "keyword", "vector"] = "hybrid"


# ---------------------------------------------------------------------------------------- answers
class FileCounts(BaseModel):
    in_progress: int
    completed: int
    failed: int
    cancelled: int
    total: int


class VectorStoreObject(BaseModel):
    id: str
    object: Literal["vector_store"] = "vector_store"
    created_at: int
    name: str | None
    usage_bytes: int
    file_counts: FileCounts
    status: Literal["expired", "in_progress", "completed"]
    expires_after: dict[str, Any] | None
    expires_at: int | None
    last_active_at: int | None
    metadata: dict[str, str]


class Page(BaseModel):
    object: Literal["list"] = "list"
    first_id: str | None
    last_id: str | None
    has_more: bool


class VectorStoreList(Page):
    data: list[VectorStoreObject]


class Deleted(BaseModel):
    id: str
    object: Literal["vector_store.deleted", "vector_store.file.deleted"]
    deleted: bool = True


class LastError(BaseModel):
    code: str
    message: str


class VectorStoreFileObject(BaseModel):
    id: str
    object: Literal["vector_store.file"] = "vector_store.file"
    usage_bytes: int
    created_at: int
    vector_store_id: str
    status: Literal["in_progress", "completed", "failed", "cancelled"]
    last_error: LastError | None
    chunking_strategy: dict[str, Any]
    attributes: dict[str, Scalar]


class VectorStoreFileList(Page):
    data: list[VectorStoreFileObject]


class FileBatchObject(BaseModel):
    id: str
    object: Literal["vector_store.files_batch"] = "vector_store.files_batch"
    created_at: int
    vector_store_id: str
    status: Literal["in_progress", "completed", "failed", "cancelled"]
    file_counts: FileCounts


class SearchContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class SearchResult(BaseModel):
    file_id: str
    filename: str
    score: float
    attributes: dict[str, Scalar]
    content: list[SearchContent]


class SearchResultsPage(BaseModel):
    object: Literal["vector_store.search_results.page"] = "vector_store.search_results.page"
    search_query: list[str]
    data: list[SearchResult]
    has_more: bool = False
    next_page: str | None = None
