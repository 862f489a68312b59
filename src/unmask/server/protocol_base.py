"""The error envelope every route returns (`APIError` -> `ErrorResponse`) and the two pydantic bases of the wire
types: `RequestModel` (unknown fields allowed and listed, strict types, null means default) and `ResponseModel`
(named fields left out when None). Re-exported by unmask.server.protocol."""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator


# ---------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The one error envelope of every route: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
               500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error the API reports to the client: HTTP status plus the OpenAI error envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "error"),
                                             param=self.param, code=self.code))


# ---------------------------------------------------------------------------------------- bases
class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null on an optional field is the field's default, as in OpenAI's API (the official
        clients send null for every argument a caller passed as None); required fields stay required."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class ResponseModel(BaseModel):
    """Response objects; fields named in `_omit_if_none` are left out instead of sent as null."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data
