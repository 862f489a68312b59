"""The batch input format, shared by the server's /v1/batches and the offline `unmask batch`.

Each line is `{"custom_id": str, "method": "POST", "url": endpoint, "body": {...}}`. A line that cannot be read
(not JSON, fields missing or mistyped, over the size limit, another endpoint) fails alone, as OpenAI does: it
becomes an error record and the other lines run. Duplicate custom_ids and a model other than the served one
fail the whole batch's validation (`validate`).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_LINES = 50_000   # OpenAI's limit on requests per batch


@dataclass
class LineError:
    status_code: int      # what the online endpoint would answer (400, 413, ...)
    message: str
    code: str | None = None
    param: str | None = None

    def envelope(self) -> dict:
        from unmask.server.protocol import ERROR_TYPES

        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status_code, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


@dataclass
class BatchLine:
    index: int                       # 0-based position among the file's non-blank lines
    number: int                      # 1-based line number in the file (what error messages name)
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    error: LineError | None = None   # the line fails without running


@dataclass
class ValidationIssue:
    """One reason the whole batch fails validation (OpenAI's `errors.data` entries)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_api(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def parse_line(raw: bytes | str, index: int, number: int, endpoint: str | None, max_line_bytes: int) -> BatchLine:
    """One non-blank input line; `endpoint` None accepts any of ENDPOINTS (the offline runner)."""
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > max_line_bytes:
        return BatchLine(index, number, _custom_id_prefix(raw), error=LineError(
            413, f"line {number} is {size} bytes, over this server's limit of {max_line_bytes} bytes per request "
                 "(--max-body-bytes)", "request_too_large"))
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return BatchLine(index, number, None, error=LineError(400, f"line {number} is not valid JSON: {e}",
                                                              "invalid_json"))
    if not isinstance(obj, dict):
        return BatchLine(index, number, None, error=LineError(400, f"line {number} is not a JSON object",
                                                              "invalid_json"))
    custom_id = obj.get("custom_id")
    line = BatchLine(index, number, custom_id if isinstance(custom_id, str) else None)
    url, method, body = obj.get("url"), obj.get("method"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        line.error = LineError(400, f"line {number}: custom_id must be a non-empty string", param="custom_id")
    elif method != "POST":
        line.error = LineError(400, f"line {number}: method must be 'POST', got {method!r}", param="method")
    elif url not in ENDPOINTS:
        line.error = LineError(400, f"line {number}: url {url!r} is not a batch endpoint; use one of "
                                    f"{', '.join(ENDPOINTS)}", param="url")
    elif endpoint is not None and url != endpoint:
        line.error = LineError(400, f"line {number}: url {url!r} does not match the batch's endpoint {endpoint!r}",
                               param="url")
    elif not isinstance(body, dict):
        line.error = LineError(400, f"line {number}: body must be a JSON object (the request body of {url})",
                               param="body")
    else:
        line.url = url
        line.body = body
    return line


def _custom_id_prefix(raw: bytes | str) -> str | None:
    """The custom_id of a line too long to parse in full, when it comes first (as clients write it)."""
    head = raw[:512].decode(errors="replace") if isinstance(raw, bytes) else raw[:512]
    start = head.find('"custom_id"')
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(head[head.index(":", start) + 1:].lstrip())
    except (ValueError, json.JSONDecodeError):
        return None
    return value if isinstance(value, str) else None


def parse_lines(data: Iterable[bytes | str], endpoint: str | None, max_line_bytes: int) -> list[BatchLine]:
    """Every non-blank line of an input file (bytes or text lines) in order."""
    out = []
    for number, raw in enumerate(data, start=1):
        if not raw.strip():
            continue
        out.append(parse_line(raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw.rstrip("\r\n"),
                              len(out), number, endpoint, max_line_bytes))
    return out


def validate(lines: list[BatchLine], model_name: str) -> list[ValidationIssue]:
    """What fails the whole batch: no request, too many, a custom_id twice, a model other than `model_name`."""
    if not lines:
        return [ValidationIssue("empty_file", "the input file has no requests")]
    if len(lines) > MAX_LINES:
        return [ValidationIssue("too_many_requests", f"the input file has {len(lines)} requests; a batch takes at "
                                                     f"most {MAX_LINES}")]
    issues, first_seen = [], {}
    for line in lines:
        if line.custom_id is not None:
            if line.custom_id in first_seen:
                issues.append(ValidationIssue(
                    "duplicate_custom_id", f"custom_id {line.custom_id!r} is on lines {first_seen[line.custom_id]} "
                                           f"and {line.number}; custom_ids must be unique within a batch",
                    line.number, "custom_id"))
            first_seen.setdefault(line.custom_id, line.number)
        model = line.body.get("model") if line.error is None else None
        if isinstance(model, str) and model != model_name:   # a mistyped model is that line's 400
            issues.append(ValidationIssue(
                "model_not_found", f"line {line.number}: model {model!r} does not exist; this server serves "
                                   f"{model_name!r} (a batch runs on one model)", line.number, "body.model"))
    return issues
