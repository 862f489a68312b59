"""The HTTP side of `unmask serve --ray`: one ingress deployment behind Ray Serve's proxy. It checks API keys,
CORS and the body size as `unmask serve` does, names the request's prompt prefix (routing.py), and streams the
answer of the engine replica that Ray Serve's router picked (replica.py). Everything else (routes, validation,
error envelopes, admission, 429s) is the replica's own `unmask serve` app.

A replica that dies while it holds a request ends that request with a 503 in the OpenAI error envelope: a JSON
body if nothing was sent yet, else an error frame in the stream (then `[DONE]` on chat and completions), never
a hang. Ray Serve replaces the replica; new requests go to the replicas still running.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.exceptions import (BackPressureError, DeploymentUnavailableError, RayServeException,
                                  ReplicaUnavailableError)

from unmask.cluster import routing
from unmask.cluster.replica import board_name
from unmask.server.metrics import Metrics
from unmask.server.protocol import APIError
from unmask.server.security import APIKeyMiddleware, BodyLimitMiddleware
from unmask.store import routes as file_routes

logger = logging.getLogger("unmask.cluster")

HEALTH_TIMEOUT_S = 5.0          # /health answers 503 when no replica answers within this
METRICS_MAX_AGE_S = 10.0        # a replica's metrics older than this (a dead one) are left out
DEAD = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
        ray.exceptions.ObjectLostError, ReplicaUnavailableError, DeploymentUnavailableError)
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


def as_api_error(e: BaseException) -> APIError:
    if isinstance(e, DEAD):
        return APIError(503, "the engine replica serving this request died; it is being replaced, retry the "
                             "request", code="replica_unavailable")
    if isinstance(e, BackPressureError):
        return APIError(429, "every engine replica is full; retry later", code="rate_limit_exceeded",
                        headers={"Retry-After": "1"})
    logger.error("request failed in the cluster: %s: %s", type(e).__name__, e)
    return APIError(500, "internal server error")


def error_frames(path: str, err: APIError, sequence: int) -> bytes:
    """The in-band end of a stream that lost its replica: as the app itself ends a stream that fails."""
    info = err.response().error
    if path == "/v1/responses":
        event = {"type": "error", "sequence_number": sequence, "code": info.code, "message": info.message,
                 "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    return f"data: {err.response().model_dump_json()}\n\ndata: [DONE]\n\n".encode()


def merged_metrics(texts: dict[str, bytes], own: Metrics) -> bytes:
    """Every replica's samples under one family each, labelled `replica`, and the ingress's own error count."""
    families: dict[str, object] = {}
    sources = dict(texts)
    sources["ingress"] = generate_latest(own.registry)
    for replica, text in sources.items():
        for family in text_string_to_metric_families(text.decode()):
            if (replica == "ingress" and family.name != "unmask:request_errors") or family.name.endswith("_created"):
                continue   # (the parser makes each counter's and histogram's _created samples a family of their own)
            merged = families.setdefault(family.name, family)
            samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
            if merged is family:
                family.samples = samples
            else:
                merged.samples.extend(samples)

    class Collected:
        def collect(self):
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collected())
    return generate_latest(registry)


def build_app(ingress: "Ingress") -> FastAPI:
    app = FastAPI(title="unmask", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = ingress.metrics

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await ingress.board_texts()
        return Response(merged_metrics(texts, ingress.metrics), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    async def forward(request: Request) -> Response:
        try:
            return await ingress.forward(request)
        except APIError as err:
            if err.status != 499:
                ingress.metrics.error(err.status)
            return JSONResponse(err.response().model_dump(), status_code=err.status, headers=err.headers)

    app.add_middleware(BodyLimitMiddleware, limit=ingress.args.max_body_bytes, metrics=ingress.metrics,
                       route_limits=file_routes.body_limits(ingress.args.max_file_bytes))
    app.add_middleware(APIKeyMiddleware, keys=ingress.args.api_keys, metrics=ingress.metrics)
    if ingress.args.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=ingress.args.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    return app


@serve.ingress()
class Ingress:
    def __init__(self, engine, args):
        self.engine, self.args = engine, args
        self.metrics = Metrics()
        self._board = None

    def __serve_build_asgi_app__(self):
        return build_app(self)

    async def board_texts(self) -> dict[str, bytes]:
        try:
            if self._board is None:
                self._board = ray.get_actor(board_name(serve.get_replica_context().app_name), namespace="unmask")
            return await self._board.read.remote(METRICS_MAX_AGE_S)
        except (ValueError, ray.exceptions.RayError):   # no replica has published yet, or the board is gone
            self._board = None
            return {}

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        message = {"method": request.method, "path": path, "query": request.scope.get("query_string", b""),
                   "headers": list(request.scope["headers"]), "body": body, "client": request.scope.get("client")}
        stream = self.engine.options(stream=True).forward.remote(message, affinity=routing.affinity_key(path, body))
        try:
            first = stream.__anext__()
            head = await (asyncio.wait_for(first, HEALTH_TIMEOUT_S) if path == "/health" else first)
        except asyncio.TimeoutError:
            stream.cancel()
            return JSONResponse({"status": "loading"}, status_code=503)
        except asyncio.CancelledError:   # the client went away before the answer began: so does the replica's work
            stream.cancel()
            raise
        except (RayServeException, ray.exceptions.RayError) as e:
            raise as_api_error(e) from None
        except StopAsyncIteration:   # the app ended without a response (a bug): an error, not a hang
            raise APIError(500, "internal server error") from None
        headers = [(k, v) for k, v in head["headers"] if k.lower() not in HOP_HEADERS]
        headers.append((b"x-unmask-replica", head["replica"].encode()))
        if not head["more"]:
            response = Response(head["body"], status_code=head["status"])
        else:
            response = StreamingResponse(self._rest(path, head["body"], stream), status_code=head["status"])
        response.raw_headers = [h for h in response.raw_headers if h[0] in (b"content-length",)] + headers
        return response

    async def _rest(self, path: str, first: bytes, stream) -> AsyncIterator[bytes]:
        sequence = -1
        finished = False
        try:
            if first:
                yield first
            async for chunk in stream:
                if path == "/v1/responses":
                    numbers = _SEQUENCE.findall(chunk)
                    sequence = int(numbers[-1]) if numbers else sequence
                yield chunk
            finished = True
        except (RayServeException, ray.exceptions.RayError) as e:
            err = as_api_error(e)
            self.metrics.error(err.status)
            finished = True
            yield error_frames(path, err, sequence + 1)
        finally:
            if not finished:   # the client went away: the replica sees the disconnect and cancels the work
                stream.cancel()
