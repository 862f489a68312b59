"""Admission: the one count of engine requests in flight, and a gate that answers 429 on arrival.

`Admission` is the only authority: at most `max_num_seqs + max_queue` engine requests (one per
choice) are admitted at a time. The serving layer acquires a request's slots when it has built its
engine jobs and releases them when they end.

Under a burst, that point comes late: a request has been read, parsed, validated, templated and
tokenised before it learns that the server is full, and every such request costs the event loop
that work while the 429s wait behind it. `AdmissionGate` (ASGI middleware) therefore takes one
slot for a generation request as soon as its headers arrive, before the body is read, and answers
429 at once when there is none. The slot travels with the request (a context variable) and the
serving layer's acquisition counts it toward the request's jobs, so the check and the reservation
are one step on the event loop and nothing can take the slot in between; a request that needs more
slots (`n > 1`, batched prompts) acquires the rest there and may still get a 429. A slot the
request never hands over (a 400, a 404, a 413, a 429 for the rest) is released when its response
has been sent.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

from unmask.server.metrics import Metrics, request_arrival
from unmask.server.protocol import APIError
from unmask.server.security import route_path, send_error

SETTLE_S = 0.002       # an admitted request starts its work once no generation request has arrived for this long,
DEFER_MAX_S = 1.0       # or this long after it arrived at the latest (a steady flood does not starve it)

# POST routes that submit engine requests (the gate takes a slot for them on arrival)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/fim/completions",
                              "/v1/apply/completions", "/v1/edit/completions", "/v1/responses"})


class _Reservation:
    """Slots the gate took for the request being handled; `held` drops to 0 once the serving layer owns them."""

    def __init__(self, admission: Admission, held: int):
        self.admission, self.held = admission, held

    def release(self) -> None:
        self.admission.release(self.held)
        self.held = 0


_reservation: ContextVar[_Reservation | None] = ContextVar("unmask_admission_reservation", default=None)


class Admission:
    """Engine requests admitted and not yet released, against `max_num_seqs + max_queue`.

    Everything runs on the event loop thread and no method awaits, so a check and its increment are atomic.
    """

    def __init__(self, max_num_seqs: int, max_queue: int):
        self.max_num_seqs, self.max_queue = max_num_seqs, max_queue
        self.capacity = max_num_seqs + max_queue
        self.inflight = 0

    def busy(self) -> APIError:
        return APIError(429, f"server busy: {self.inflight} requests in flight, limit {self.max_num_seqs} running + "
                             f"{self.max_queue} queued", code="queue_full", headers={"Retry-After": "1"})

    def acquire(self, n: int) -> None:
        """Admit `n` engine requests (429 if they do not fit); the caller releases `n` when they end.

        Slots the gate reserved for the current request count toward `n`."""
        reservation = _reservation.get()
        mine = reservation is not None and reservation.admission is self
        extra = n - (reservation.held if mine else 0)
        if self.inflight + extra > self.capacity:
            raise self.busy()   # the reservation, if any, is released when the response has been sent
        self.inflight += extra
        if mine:
            reservation.held = 0    # the caller owns all n now

    def reserve(self) -> _Reservation:
        """One slot for a request whose jobs are not built yet (429 if there is none)."""
        if self.inflight + 1 > self.capacity:
            raise self.busy()
        self.inflight += 1
        return _Reservation(self, 1)

    def release(self, n: int) -> None:
        self.inflight -= n


class AdmissionGate:
    """Takes a slot for each generation request on arrival (429 when there is none), before the body is read.

    `admission()` returns the serving layer's `Admission`, or None while the model loads (the route answers
    503 then). Runs after the API key check (a request without a key neither takes a slot nor learns that the
    server is busy) and before the body size limit, which may read a chunked body.
    """

    def __init__(self, app: ASGIApp, admission: Callable[[], Admission | None], metrics: Metrics):
        self.app, self.admission, self.metrics = app, admission, metrics
        self.last_arrival = -math.inf   # time.monotonic() when the latest generation request arrived
        self._settled: asyncio.Future | None = None   # resolves once arrivals pause for SETTLE_S

    async def _watch(self, settled: asyncio.Future) -> None:
        while (wait := self.last_arrival + SETTLE_S - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        settled.set_result(None)

    async def _settle(self, arrived: float) -> None:
        """Let a burst be sorted before any of it is worked on: wait until no request has arrived for SETTLE_S
        (a lone request: SETTLE_S after it arrived), at most until DEFER_MAX_S after this one arrived.

        An admitted request next reads, validates and tokenises its body and starts the engine, whose steps then
        share the CPU with the event loop and slow down every 429 still to be sent: on 2 cores one request let
        through early doubled the 429s' latency in a burst of 500 (docs/server.md). One watcher per burst.
        """
        if self._settled is None or self._settled.done():
            self._settled = asyncio.get_running_loop().create_future()
            self._watcher = asyncio.ensure_future(self._watch(self._settled))
        try:
            await asyncio.wait_for(asyncio.shield(self._settled), arrived + DEFER_MAX_S - time.monotonic())
        except TimeoutError:
            pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = None
        if scope["type"] == "http" and scope["method"] == "POST" and route_path(scope) in GENERATION_PATHS:
            admission = self.admission()
        if admission is None:
            return await self.app(scope, receive, send)
        arrived = self.last_arrival = time.monotonic()
        try:
            reservation = admission.reserve()
        except APIError as busy:
            return await send_error(busy, scope, receive, send, self.metrics)
        token, clock = _reservation.set(reservation), request_arrival.set(time.perf_counter())
        try:
            await self._settle(arrived)
            await self.app(scope, receive, send)
        finally:
            request_arrival.reset(clock)
            _reservation.reset(token)
            reservation.release()
