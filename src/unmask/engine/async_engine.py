"""Asynchronous front end: the step loop runs in one background thread; callers await per-request events.

Requests join and leave between steps. The engine is guarded by one lock held for a step, so
adding or aborting a request waits at most one step and never races the scheduler.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
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
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="unmask-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_unfinished()
                outputs = self._step() if busy else []
            for out in outputs:
                self._deliver(out.request_id, out)
                if out.finished:
                    self._deliver(out.request_id, _FINISHED)
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

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

    # ------------------------------------------------------------------ API
    @property
    def is_alive(self) -> bool:
        return not self._stop and self._error is None

    def num_running(self) -> int:
        return self.engine.num_running

    def num_waiting(self) -> int:
        return self.engine.num_waiting

    async def generate(self, prompt_ids: list[int], params: GenerationParams,
                       request_id: str | None = None) -> AsyncIterator[StepOutput]:
        """Yields this request's events until it finishes; cancelling the iterator aborts the request."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        rid = request_id or f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.engine.num_waiting >= self.max_queue:
                raise QueueFullError(f"server busy: {self.engine.num_waiting} requests already queued")
            self._queues[rid] = (asyncio.get_running_loop(), queue)
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid)
            except BaseException:
                self._queues.pop(rid, None)
                raise
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _FINISHED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)

    def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop the loop; with `drain`, first let running requests finish (bounded by `timeout`)."""
        if drain:
            deadline = threading.Event()
            waited = 0.0
            while self.engine.has_unfinished() and waited < timeout and self.is_alive:
                deadline.wait(0.05)
                waited += 0.05
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
