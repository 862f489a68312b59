"""Runs one batch line through the server's own routes, in this process: the same pydantic request models,
validation, serving code and error envelopes as an online request, without HTTP and without the middleware
(API keys, admission gate, body limit), which guard the network side.

The route is called as an ASGI app (`app.router`, wrapped in the app's exception handlers), so each endpoint
keeps its one definition in unmask.server.app, and one added there (embeddings) is batchable with no code
here. Requests submitted from a batch run at BATCH_PRIORITY in the engine (serving.request_priority).
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.middleware.asyncexitstack import AsyncExitStackMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.routing import Match

from unmask.batch.lines import BatchLine, LineError
from unmask.engine.params import BATCH_PRIORITY

logger = logging.getLogger("unmask.batch")


@dataclass
class LineResult:
    status_code: int
    body: Any                  # the response body (JSON), or the error envelope
    request_id: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


def served(app, url: str) -> bool:
    """Whether the app has a POST route at `url`."""
    scope = {"type": "http", "method": "POST", "path": url, "root_path": ""}
    return any(route.matches(scope)[0] is Match.FULL for route in app.router.routes)


def served_model(app, endpoint: str) -> str:
    """The model id a batch's lines must name: the embedding model's on /v1/embeddings, else the served model's."""
    if endpoint == "/v1/embeddings":
        retrieval = getattr(app.state, "retrieval", None)
        return getattr(retrieval, "encoder_name", "")
    return app.state.serving.cfg.model_name


class RouteCaller:
    def __init__(self, app):
        self.app = app
        self._handler = None

    @property
    def handler(self):
        """FastAPI's own middleware stack, less the user middleware: the app's exception handlers (read on first
        use, once the app has installed them) around the router, and the exit stack its routes expect."""
        if self._handler is None:
            self._handler = ExceptionMiddleware(AsyncExitStackMiddleware(self.app.router),
                                                handlers=dict(self.app.exception_handlers))
        return self._handler

    async def run(self, line: BatchLine) -> LineResult:
        request_id = "req_" + uuid.uuid4().hex
        if line.error is not None:
            return LineResult(line.error.status_code, line.error.envelope(), request_id)
        if line.body.get("stream"):
            return LineResult(400, LineError(400, "stream is not supported in a batch; leave it unset or false",
                                             param="stream").envelope(), request_id)
        from unmask.server.serving import request_priority

        request_priority.set(BATCH_PRIORITY)   # this task's context only
        status, body = await self._call(line.url, json.dumps(line.body).encode())
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            parsed = body.decode(errors="replace")
        return LineResult(status, parsed, request_id)

    async def _call(self, url: str, payload: bytes) -> tuple[int, bytes]:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": url, "raw_path": url.encode(), "root_path": "",
                 "query_string": b"", "client": ("batch", 0), "server": ("batch", 0), "app": self.app,
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]}
        sent = False
        never = asyncio.Event()   # after the body, nothing: the "client" never disconnects (cancel the task instead)
        status, chunks = 500, []

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.handler(scope, receive, send)
        except Exception:  # noqa: BLE001 - the app's handlers answer every error; a bug is this line's 500
            logger.exception("batch line to %s failed", url)
            return 500, json.dumps(LineError(500, "internal server error").envelope()).encode()
        return status, b"".join(chunks)
