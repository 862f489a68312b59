"""One engine replica of `unmask serve --ray`: the whole `unmask serve` app (routes, error envelopes, admission,
metrics, the model) in a Ray Serve replica, answering the requests the ingress forwards.

`forward` runs one HTTP request through the app as ASGI in this process and streams the response back: first a
head `{"status", "headers", "body", "more", "replica"}` holding the first body bytes, then the rest of the body
in pieces as the app sends them (one SSE frame or more each), the last one marked as `{"end": bytes}`; or, when
the gateway asks for it, the rest over a socket of its own (pipe.py), the call ending once it is written. When
the caller goes away (the client disconnected, the ingress dropped the stream), the app's `receive` answers
`http.disconnect`, as uvicorn would, so the serving code cancels the engine requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import ray
from ray import serve

from unmask.cluster.pipe import CONNECT_TIMEOUT_S, PipeServer

logger = logging.getLogger("unmask.cluster")

PUBLISH_EVERY_S = 1.0        # how often a replica posts its /metrics text to the board


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest /metrics text of every engine replica (the ingress cannot reach replicas one by one)."""

    def __init__(self):
        self.texts: dict[str, tuple[float, bytes]] = {}

    def post(self, replica: str, text: bytes) -> None:
        self.texts[replica] = (time.time(), text)

    def drop(self, replica: str) -> None:
        self.texts.pop(replica, None)

    def read(self, max_age_s: float) -> dict[str, bytes]:
        now = time.time()
        return {r: text for r, (t, text) in self.texts.items() if now - t <= max_age_s}


async def _body_pieces(messages: asyncio.Queue):
    """The app's ASGI messages as the response's head `{"status", "headers", "body", "more"}` and then its body as
    `(bytes, more)` pieces; frames the app sent while the last piece was on its way travel as one."""
    head = None
    while True:
        message = await messages.get()
        if message is None:
            return
        if message["type"] == "http.response.start":
            head = {"status": message["status"], "headers": message.get("headers", [])}
            continue
        if message["type"] != "http.response.body":
            continue
        body, more = message.get("body", b""), message.get("more_body", False)
        while more and not messages.empty():
            following = messages.get_nowait()
            if following is None:   # the app returned without ending its body
                more = False
                break
            if following["type"] == "http.response.body":
                body += following.get("body", b"")
                more = following.get("more_body", False)
        if head is not None:
            head.update(body=body, more=more)
            yield head
            head = None
        else:
            yield body, more
        if not more:
            return


def board_name(app_name: str) -> str:
    return f"unmask-metrics-{app_name}"


def run_at(niceness: int) -> None:
    """Ray starts its workers at nice 15; an engine there loses the CPU to everything else on a busy machine (on
    the 2-core machine of docs/scale-out.md, 0.79x plain `unmask serve`'s throughput against 0.90x at nice 0).
    Linux keeps a niceness per thread and new threads inherit it, so every thread the worker has is set, not only
    this one: Ray's own (its main thread sends each streamed item back to the gateway) as well as the engine's,
    which start after this. Left at 15 beside an engine at 0, that main thread waited for the engine's steps: at
    four streams the first token through Ray came 24-31 ms after plain serving's, 15-20 ms with every thread
    set (docs/scale-out.md, "Ray's own priorities and its gRPC path"). Lowering it needs the privilege to
    (CAP_SYS_NICE); without, the replica keeps Ray's."""
    import os

    threads = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except ProcessLookupError:   # a thread that ended meanwhile
            continue
        except OSError as e:
            logger.info("engine replica stays at nice %d (%s)", os.getpriority(os.PRIO_PROCESS, 0), e.strerror)
            return


class EngineReplica:
    async def __init__(self, args, threads: int, niceness: int | None = None):
        import torch

        from unmask.server.app import create_app

        if niceness is not None:
            run_at(niceness)
        torch.set_num_threads(max(1, threads))
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        rank = getattr(ctx.rank, "rank", ctx.rank)
        # every replica opens the same store (the --data-dir of its node, or the --database-url of every node):
        # batches and ingestion are claimed row by row in its database (store/claims.py), so each batch and file
        # is worked on by one replica at a time, whichever got the work
        self.app = create_app(args)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        state = self.app.state
        from unmask.retrieval import routes as retrieval

        while (state.serving is None or retrieval.loading(state)) and not state.load_error:
            await asyncio.sleep(0.05)
        if state.load_error:
            raise RuntimeError(f"cannot load the model: {state.load_error}")
        self._board = MetricsBoard.options(name=board_name(ctx.app_name), namespace="unmask", get_if_exists=True,
                                           lifetime="detached").remote()
        self._publisher = asyncio.create_task(self._publish())
        self._pipes = PipeServer()
        try:
            await self._pipes.start(ray.util.get_node_ip_address())
        except OSError as e:   # no direct path: the bodies go through Ray
            logger.warning("engine replica %s: no body pipe (%s); streamed bodies go through Ray", self.replica_id, e)
        logger.info("engine replica %s (rank %s) ready", self.replica_id, rank)

    async def _publish(self) -> None:
        while True:
            try:
                await self._board.post.remote(self.replica_id, self.app.state.metrics.render())
            except ray.exceptions.RayError as e:   # the board went away with the app; keep serving
                logger.debug("metrics board: %s", e)
            await asyncio.sleep(PUBLISH_EVERY_S)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; a dead engine loop gets the replica replaced."""
        if not self.app.state.serving.engine.is_alive:
            raise RuntimeError("the engine loop has stopped")

    async def forward(self, request: dict[str, Any], affinity: str | None = None, avoid: str | None = None,
                      direct: bool = False):
        """One HTTP request (`method`, `path`, `root_path`, `query`, `headers` as byte pairs, `body`) through the
        app. With `direct`, the rest of a streamed body goes over this replica's body pipe (pipe.py), the head
        naming it as `pipe`: (host, port, token). (`affinity` and `avoid` are for the router, routing.py.)"""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": request["method"], "scheme": "http", "path": request["path"],
                 "raw_path": request["path"].encode(), "root_path": request.get("root_path", ""),
                 "query_string": request["query"],
                 "headers": request["headers"], "client": request.get("client"), "server": None, "state": {}}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(scope, receive, messages.put)
            finally:
                messages.put_nowait(None)

        task = asyncio.create_task(run())
        pipe = None
        try:
            pieces = _body_pieces(messages)
            try:
                head = await pieces.__anext__()
            except StopAsyncIteration:   # the app ended without a response: the gateway answers 500
                return
            head["replica"] = self.replica_id
            if not (head["more"] and direct and self._pipes.address):
                yield head
                async for body, more in pieces:
                    if not more:   # the end, marked: the gateway ends the response now, not one Ray call later
                        yield {"end": body}
                    elif body:
                        yield body
                return
            pipe = self._pipes.open()
            left = asyncio.ensure_future(pipe.closed.wait())
            left.add_done_callback(lambda _: gone.set())   # the gateway left: the app sees the client go
            head["pipe"] = (*self._pipes.address, pipe.token)
            yield head
            try:
                await asyncio.wait_for(pipe.connected.wait(), CONNECT_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("the gateway did not collect a streamed body within %.0f s; dropping it",
                               CONNECT_TIMEOUT_S)
                return
            async for body, more in pieces:
                if body:
                    pipe.put(body)
                    await pipe.drain()
                if not more:
                    break
            pipe.end()
            await pipe.closed.wait()   # written, or the gateway left: the call (Serve's count of it) ends after
        finally:
            if pipe is not None:
                self._pipes.close(pipe)
                left.cancel()
            gone.set()   # the app sees the client go (a no-op once it has answered)
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, 5.0)

    async def __del__(self):
        self._publisher.cancel()
        with contextlib.suppress(Exception):
            self._board.drop.remote(self.replica_id)
        await self._lifespan.aclose()   # drains the engine (--drain-timeout), as unmask serve does on shutdown
        await self._pipes.stop()   # after the drain: the bodies it finished are written out first
