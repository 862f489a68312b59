"""The HTTP side of `unmask serve --ray`: the gateway in front of the engine replicas. It checks API keys, CORS and
the body size as `unmask serve` does, names the request's prompt prefix (routing.py), and streams the answer of
the engine replica that Ray Serve's router picked (replica.py). Everything else (routes, validation, error
envelopes, admission, 429s) is the replica's own `unmask serve` app.

`unmask serve --ray` runs the gateway in its own process under uvicorn (front.py), one streamed handle call from the
engine replicas; Serve config files and KubeRay run it as the `Ingress` deployment behind Ray Serve's HTTP proxy.

A replica that dies before it answered (nothing was sent to the client yet) gets the request once more, on another
replica (or on its replacement); a replica that dies after that, or twice, ends the request with a 503 in the
OpenAI error envelope: a JSON body if nothing was sent yet, else an error frame in the stream (then `[DONE]` on chat
and completions), never a hang.
"""
from __future__ import annotations

import asyncio
import contextlib
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

from unmask.cluster import pipe as pipe_path
from unmask.cluster import routing
from unmask.cluster.replica import board_name
from unmask.server.metrics import Metrics
from unmask.server.protocol import APIError
from unmask.server.security import APIKeyMiddleware, BodyLimitMiddleware, route_path
from unmask.store import routes as file_routes

logger = logging.getLogger("unmask.cluster")

HEALTH_TIMEOUT_S = 5.0          # /health answers 503 when no replica answers within this
METRICS_MAX_AGE_S = 10.0        # a replica's metrics older than this (a dead one) are left out
RETRY_ROUTE_S = 60.0            # a retried request waits this long for a live replica (a replacement loading)
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


def retryable(method: str, path: str) -> bool:
    """A request that no replica answered may run again, unless it changes the files, batches or vector stores
    (an upload the dead replica had stored would be stored twice)."""
    return method in ("GET", "HEAD") or not path.startswith(routing.STATE_PREFIXES)


def dead_actor(e: BaseException) -> str | None:
    """The hex actor id of the replica that died, as Ray names it in the error (a task error wraps it)."""
    for err in (e, getattr(e, "cause", None)):
        if isinstance(err, ray.exceptions.RayActorError) and getattr(err, "actor_id", None):
            return err.actor_id
    return None


def error_frames(path: str, err: APIError, sequence: int) -> bytes:
    """The in-band end of a stream that lost its replica: as the app itself ends a stream that fails."""
    info = err.response().error
    if path == "/v1/responses":
        event = {"type": "error", "sequence_number": sequence, "code": info.code, "message": info.message,
                 "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    return f"data: {err.response().model_dump_json()}\n\ndata: [DONE]\n\n".encode()


def merged_metrics(texts: dict[str, bytes], own: Metrics) -> bytes:
    """Every replica's samples under one family each, labelled `replica`, and the gateway's own error count."""
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


class Gateway:
    """Forwards HTTP requests to the engine deployment through `engine` (a DeploymentHandle)."""

    def __init__(self, engine, args, app_name: str, direct: bool = True):
        self.engine, self.args, self.app_name = engine, args, app_name
        self.direct = direct   # streamed bodies over the replicas' body pipes (pipe.py) rather than as Ray objects
        self.metrics = Metrics()
        self._board = None
        self._ending: set[asyncio.Task] = set()

    async def board_texts(self) -> dict[str, bytes]:
        try:
            if self._board is None:
                self._board = ray.get_actor(board_name(self.app_name), namespace="unmask")
            return await self._board.read.remote(METRICS_MAX_AGE_S)
        except (ValueError, ray.exceptions.RayError):   # no replica has published yet, or the board is gone
            self._board = None
            return {}

    async def _head(self, message: dict, affinity: str | None, avoid: str | None):
        """Send the request to a replica; its stream and first item (the status, headers and first body bytes)."""
        stream = self.engine.options(stream=True).forward.remote(message, affinity=affinity, avoid=avoid,
                                                                 direct=self.direct)
        path = message["path"]
        try:
            if avoid is not None:   # a retry: the router waits for a live replica, but not for ever
                routed = getattr(stream, "_fetch_future_result_async", None)
                if routed is not None:
                    await asyncio.wait_for(routed(), RETRY_ROUTE_S)
            first = stream.__anext__()
            return stream, await (asyncio.wait_for(first, HEALTH_TIMEOUT_S) if path == "/health" else first)
        except BaseException:
            stream.cancel()
            raise

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        scope = request.scope
        path = scope["path"]
        route = route_path(scope)
        message = {"method": request.method, "path": path, "root_path": scope.get("root_path", ""),
                   "query": scope.get("query_string", b""), "headers": list(scope["headers"]), "body": body,
                   "client": scope.get("client")}
        affinity = routing.affinity_key(route, body, shared_store=bool(self.args.database_url))
        avoid = None
        while True:
            try:
                stream, head = await self._head(message, affinity, avoid)
            except asyncio.TimeoutError:
                if route == "/health":
                    return JSONResponse({"status": "loading"}, status_code=503)
                raise APIError(503, "no engine replica is running; retry the request", code="replica_unavailable")
            except (RayServeException, ray.exceptions.RayError) as e:
                if avoid is None and isinstance(e, DEAD) and retryable(request.method, route):
                    avoid = dead_actor(e) or ""
                    logger.warning("engine replica %s died before answering %s %s; sending it to another replica",
                                   avoid or "?", request.method, route)
                    continue
                raise as_api_error(e) from None
            except StopAsyncIteration:   # the app ended without a response (a bug): an error, not a hang
                raise APIError(500, "internal server error") from None
            if "pipe" not in head:
                break
            try:
                pipe = await pipe_path.connect(head["pipe"][:2], head["pipe"][2])
                break
            except (OSError, asyncio.TimeoutError) as e:   # the replica's port is not reachable from here
                stream.cancel()
                self.direct = False
                logger.warning("cannot reach engine replica %s's body pipe at %s:%s (%s); streamed bodies go "
                               "through Ray from now on", head["replica"], *head["pipe"][:2], e)
                if not retryable(request.method, route):
                    raise APIError(503, "the engine replica could not be reached; retry the request",
                                   code="replica_unavailable") from None
        headers = [(k, v) for k, v in head["headers"] if k.lower() not in HOP_HEADERS]
        headers.append((b"x-unmask-replica", head["replica"].encode()))
        if not head["more"]:
            response = Response(head["body"], status_code=head["status"])
        elif "pipe" in head:
            response = StreamingResponse(self._piped(route, head["body"], stream, *pipe), status_code=head["status"])
        else:
            response = StreamingResponse(self._rest(route, head["body"], stream), status_code=head["status"])
        response.raw_headers = [h for h in response.raw_headers if h[0] in (b"content-length",)] + headers
        return response

    def _rest(self, route: str, first: bytes, stream) -> AsyncIterator[bytes]:
        """The rest of a body as Ray items, the last one marked (replica.py)."""
        return self._relay(route, first, stream, _ray_pieces(stream))

    def _piped(self, route: str, first: bytes, stream, reader, writer) -> AsyncIterator[bytes]:
        """The rest of a body over the replica's pipe; the Ray call ends by itself once the replica has written it."""
        return self._relay(route, first, stream, self._pipe_pieces(stream, reader, writer))

    async def _relay(self, route: str, first: bytes, stream, pieces) -> AsyncIterator[bytes]:
        """The response body from `pieces` (`(bytes, last)`); a replica lost mid-body ends it with an error frame,
        a client that leaves before the end cancels the call (the replica sees the disconnect, the work stops)."""
        sequence = -1
        finished = False
        try:
            async with contextlib.aclosing(pieces):
                if first:
                    yield first
                async for chunk, last in pieces:
                    finished = last   # a client that goes after the last bytes cancels nothing
                    if route == "/v1/responses":
                        numbers = _SEQUENCE.findall(chunk)
                        sequence = int(numbers[-1]) if numbers else sequence
                    if chunk:
                        yield chunk
                    if last:   # end the response here: the replica's own wind-down (the app returning) is not on
                        break  # the client's clock
                finished = True
        except _Lost as lost:
            self.metrics.error(lost.err.status)
            finished = True
            yield error_frames(route, lost.err, sequence + 1)
        finally:
            if not finished:
                stream.cancel()

    async def _pipe_pieces(self, stream, reader, writer):
        try:
            async for piece in pipe_path.read_body(reader):
                yield piece, False
            self._end_later(stream)
            yield b"", True
        except pipe_path.PipeBroken:   # the replica went away mid-body: its call says how
            raise _Lost(await self._why(stream)) from None
        finally:
            writer.close()

    async def _why(self, stream) -> APIError:
        try:
            async for _ in stream:
                pass
        except (RayServeException, ray.exceptions.RayError) as e:
            return as_api_error(e)
        return as_api_error(ray.exceptions.RayActorError())

    def _end_later(self, stream) -> None:
        """Read the call's end off the client's clock (Ray Serve counts the request as running until then)."""
        async def end():
            with contextlib.suppress(Exception):
                async for _ in stream:
                    pass

        task = asyncio.ensure_future(end())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)


class _Lost(Exception):
    """The replica went away mid-body; `err` is what the client is told."""

    def __init__(self, err: APIError):
        super().__init__(err.message)
        self.err = err


async def _ray_pieces(stream):
    try:
        async for item in stream:
            if isinstance(item, dict):   # the replica's marked end: its body is complete
                yield item["end"], True
                return
            yield item, False
    except (RayServeException, ray.exceptions.RayError) as e:
        raise _Lost(as_api_error(e)) from None


def build_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="unmask", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = gateway.metrics

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await gateway.board_texts()
        return Response(merged_metrics(texts, gateway.metrics), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    async def forward(request: Request) -> Response:
        try:
            return await gateway.forward(request)
        except APIError as err:
            if err.status != 499:
                gateway.metrics.error(err.status)
            return JSONResponse(err.response().model_dump(), status_code=err.status, headers=err.headers)

    app.add_middleware(BodyLimitMiddleware, limit=gateway.args.max_body_bytes, metrics=gateway.metrics,
                       route_limits=file_routes.body_limits(gateway.args.max_file_bytes))
    app.add_middleware(APIKeyMiddleware, keys=gateway.args.api_keys, metrics=gateway.metrics)
    if gateway.args.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=gateway.args.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    return app


@serve.ingress()
class Ingress:
    """The gateway as a Ray Serve deployment, behind Serve's HTTP proxy (Serve config files, KubeRay)."""

    def __init__(self, engine, args):
        self.gateway = Gateway(engine, args, serve.get_replica_context().app_name, direct=pipe_path.wanted())

    def __serve_build_asgi_app__(self):
        return build_app(self.gateway)
