"""Asynchronous front end: the step loop owns the engine in one background thread.

Callers never touch the engine: adds and aborts go through an inbox that the loop drains between
steps, so a new request or a cancellation never waits for a step to finish (the event loop stays
free) and requests join and leave exactly at step boundaries.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator

from unmask.engine.engine import Engine
from unmask.engine.outputs import StepOutput
from unmask.engine.params import GenerationParams
from unmask.errors import UnmaskError


class QueueFullError(UnmaskError):
    """More requests are waiting than --max-queue allows; the server answers 429."""


class EngineDeadError(UnmaskError):
    """The step loop crashed; requests in flight receive this error."""


_FINISHED = object()


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue: int = 256):
        self.engine = engine
        self.max_queue = max_queue
        self._inbox: deque[tuple] = deque()   # ("add", rid, prompt, params) | ("abort", rid) | ("abort_all",)
        self._inbox_lock = threading.Lock()
        self._pending_adds = 0
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="unmask-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop (engine thread only)
    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            busy = self.engine.has_unfinished()
            for out in self._step() if busy else []:
                self._deliver(out.request_id, out if out.error is None else out.error)
                if out.finished:
                    self._deliver(out.request_id, _FINISHED)
            if not busy and not self._inbox:
                self._wake.wait(0.05)
                self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    return
                item = self._inbox.popleft()
                if item[0] == "add":
                    self._pending_adds -= 1
            if item[0] == "abort_all":
                self._abort_all()
                continue
            if item[0] == "add":
                _, rid, prompt, params = item
                if rid not in self._queues:  # cancelled before it was admitted
                    continue
                try:
                    self.engine.add_request(prompt, params, request_id=rid)
                except Exception as e:  # noqa: BLE001 - checked up front; anything left goes to that caller
                    self._deliver(rid, e)
            else:
                self.engine.abort(item[1])

    def _abort_all(self) -> None:
        """Every request still open ends now: its caller gets the engine's abort output (finish_reason "abort"),
        or, where the engine never admitted it, an EngineDeadError."""
        for rid in list(self._queues):
            out = self.engine.abort(rid)
            self._deliver(rid, out if out is not None else EngineDeadError("the server is shutting down"))
            self._deliver(rid, _FINISHED)

    def _step(self) -> list[StepOutput]:
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - a crashed step fails every request in flight, loudly
            self._error = e
            self._stop = True
            for rid in list(self._queues):
                self._deliver(rid, EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))
            return []

    def _deliver(self, request_id: str, item) -> None:
        entry = self._queues.get(request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    # ------------------------------------------------------------------ API (any thread)
    @property
    def is_alive(self) -> bool:
        return not self._stop and self._error is None

    def num_running(self) -> int:
        return self.engine.num_running

    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending_adds

    async def generate(self, prompt_ids: list[int], params: GenerationParams,
                       request_id: str | None = None) -> AsyncIterator[StepOutput]:
        """Yields this request's events until it finishes; closing the iterator aborts the request."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        self.engine.check_request(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._inbox_lock:
            if self.num_waiting() >= self.max_queue:
                raise QueueFullError(f"server busy: {self.num_waiting()} requests already queued")
            self._queues[rid] = (asyncio.get_running_loop(), queue)
            self._inbox.append(("add", rid, list(prompt_ids), params))
            self._pending_adds += 1
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _FINISHED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._inbox_lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def abort_all(self) -> None:
        """End every open request (the drain timeout of a shutdown ran out); new ones are still taken."""
        with self._inbox_lock:
            self._inbox.append(("abort_all",))
        self._wake.set()

    def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop the loop; with `drain`, first let running requests finish (bounded by `timeout`)."""
        waited, tick = 0.0, threading.Event()
        while drain and (self.engine.has_unfinished() or self._inbox) and waited < timeout and self.is_alive:
            tick.wait(0.05)
            waited += 0.05
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
