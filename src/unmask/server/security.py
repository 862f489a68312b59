"""ASGI middleware guarding every route: API keys and the request body size limit."""
from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unmask.server.metrics import Metrics
from unmask.server.protocol import APIError
from unmask.web.routes import PATHS as PAGE_PATHS

# reachable without a key: /health (load balancers, orchestrators) and the playground page, which asks for the key
OPEN_PATHS = frozenset({"/health"}) | PAGE_PATHS


def route_path(scope: Scope) -> str:
    """The path the app routes on: under `--root-path /p`, uvicorn puts /p in front of the path the proxy passed."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and (path == root or path.startswith(root + "/")) else path


async def send_error(err: APIError, scope: Scope, receive: Receive, send: Send, metrics: Metrics) -> None:
    metrics.error(err.status)
    await JSONResponse(err.response().model_dump(), status_code=err.status, headers=err.headers)(scope, receive, send)


def _digest(secret: bytes) -> bytes:
    # comparing fixed-length digests keeps the key's length out of the timing as well
    return hashlib.sha256(secret).digest()


class APIKeyMiddleware:
    """With keys set, every route but /health needs `Authorization: Bearer <key>` (401 otherwise)."""

    def __init__(self, app: ASGIApp, keys: list[str], metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.keys = [_digest(k.encode()) for k in keys]

    def authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        given = _digest(token.strip()) if scheme.lower() == b"bearer" else b""
        ok = False
        for key in self.keys:  # no early exit: every key is compared
            ok |= hmac.compare_digest(given, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or route_path(scope) in OPEN_PATHS or self.authorized(scope):
            return await self.app(scope, receive, send)
        err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
        await send_error(err, scope, receive, send, self.metrics)


class BodyLimitMiddleware:
    """Refuses request bodies over `limit` bytes with a 413 that names the limit.

    A declared Content-Length is checked before reading; a chunked body is read (up to the limit)
    and replayed to the app. `route_limits` gives paths their own (limit, message): file uploads
    are bounded by --max-file-bytes, not --max-body-bytes.
    """

    def __init__(self, app: ASGIApp, limit: int, metrics: Metrics,
                 route_limits: dict[str, tuple[int, str]] | None = None):
        self.app, self.limit, self.metrics = app, limit, metrics
        self.route_limits = route_limits or {}

    def _limit(self, scope: Scope) -> tuple[int, str]:
        return self.route_limits.get(route_path(scope)) or (
            self.limit, f"request body is larger than this server's limit of {self.limit} bytes (--max-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, message = self._limit(scope)
        error = APIError(413, message, code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                return await send_error(error, scope, receive, send, self.metrics)
            return await self.app(scope, receive, send)
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                return await send_error(error, scope, receive, send, self.metrics)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
