"""Admission and per-step planning: which requests run this step and what each one feeds."""
from __future__ import annotations

from collections import deque
from typing import Callable

from unmask.engine.sequence import Sequence, Status, StepPlan


class Scheduler:
    def __init__(self, max_num_seqs: int = 64, max_batch_tokens: int = 4096):
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # slots requests of a priority above 0 (batch lines) may hold at once; None: all. The rest stay free for
        # interactive requests, which then start at once however many batch lines are queued
        self.background_slots: int | None = None
        # a KV pool's allocation at admission (Engine._attach_cache): False leaves the request waiting for room
        self.admit: Callable[[Sequence], bool] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for q in (self.running, self.waiting):
            for s in q:
                if s.request_id == request_id:
                    q.remove(s)
                    s.finish("abort")
                    return s
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _next_waiting(self) -> Sequence | None:
        """The waiting request to admit: the lowest `priority`, the earliest among equals (None: only background
        requests wait and they hold their `background_slots` already)."""
        first = self.waiting[0]
        best = min(self.waiting, key=lambda s: s.params.priority)  # min keeps the first of equal keys
        if best.params.priority > 0 and self.background_slots is not None and self.background_slots <= sum(
                seq.params.priority > 0 for seq in self.running):
            return None
        if best is first:
            return self.waiting.popleft()
        self.waiting.remove(best)
        return best

    def schedule(self) -> list[StepPlan]:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self._next_waiting()
            if seq is None:
                break
            if self.admit is not None and not self.admit(seq):
                self.waiting.appendleft(seq)
                break
            seq.status = Status.RUNNING
            self.running.append(seq)
        budget = self.max_batch_tokens
        plans = []
        # a running request waits while a more urgent one runs (its state is kept, it resumes after): an
        # interactive request's steps then cost what they cost on an idle engine, however many batch lines run
        urgent = min((seq.params.priority for seq in self.running), default=0)
        for seq in self.running:
            if seq.params.priority > urgent:
                continue
            planned = seq.plan(max(budget, seq.B))
            for plan in planned if isinstance(planned, list) else [planned]:  # infill probes feed several canvases
                budget -= plan.segment.length
                plans.append(plan)
        return plans

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.status is Status.FINISHED]
        if done:
            self.running = [s for s in self.running if s.status is not Status.FINISHED]
        return done
