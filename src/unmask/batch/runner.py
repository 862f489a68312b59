"""The server's batch runner: one asyncio task on the server's event loop that works through the active batches
in the store, oldest first, and resumes any that a crash or a restart left active.

Per batch: validating (read the input file, `lines.validate`), in_progress (the lines without a saved result,
each through the online route in this process at batch priority, at most `max_running` in engine slots and as
many queued; each result is saved as it finishes), finalizing (output and error files written from the saved results), then completed. A
cancel stops new lines at once, aborts those in flight and keeps the finished ones; the lines that never ran go
to the error file as batch_cancelled (batch_expired past the completion window), so that every custom_id is in
exactly one of the two files.

Several server processes may share one database (two `unmask serve` on one data directory, the replicas of
`unmask serve --ray` on one machine): a runner runs only a batch it has claimed (store/claims.py: one conditional
UPDATE, a lease renewed by a heartbeat thread, every state change fenced on still holding it), so each batch runs
in one process at a time and each line once. A cancel received by another process reaches the running one
through the database: it polls its batch's status every WATCH_S.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from unmask.batch.execute import RouteCaller, served, served_model
from unmask.batch.jobs import ACTIVE, BatchJobs, batch_usage, result_record, unrun_record
from unmask.batch.lines import BatchLine, ValidationIssue, parse_lines, validate
from unmask.store import FileNotFound, LazyStore, StoreUnavailable
from unmask.store.claims import ClaimLost, Claims, Heartbeat, process_owner

logger = logging.getLogger("unmask.batch")

RETRY_S = 0.5            # a line the server answered 429 (busy) or 503 (engine not running) is tried again after this
IDLE_WAKE_S = 1.0        # an idle runner looks for work at least this often (expiry, batches from another process)
WATCH_S = 1.0            # how often a running batch's status is read (a cancel from another process, a lost claim)
OUTPUT_MAX_BYTES = 2**40  # output files are the server's own: not bounded by --max-file-bytes


def default_batch_inflight(max_num_seqs: int) -> int:
    """Engine slots batch lines may hold by default: three quarters, so that an interactive request finds a free
    slot at once (the engine then pauses the batch lines while it runs: scheduler.py)."""
    return max(1, max_num_seqs - max(1, max_num_seqs // 4))


class BatchRunner:
    def __init__(self, app, store: LazyStore, max_running: int, max_line_bytes: int):
        """`max_running`: engine slots batch lines may hold (the scheduler's background_slots); as many more
        lines wait in the engine's queue, so that a slot a line frees is refilled in the same step."""
        self.app, self.lazy_store = app, store
        self.max_running, self.max_line_bytes = max(1, max_running), max_line_bytes
        self.max_inflight = 2 * self.max_running
        self.caller = RouteCaller(app)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._current: str | None = None
        self._in_flight: set[asyncio.Task] = set()
        self._halt = False   # the current batch was cancelled (or its claim lost): start no more lines
        self.owner = process_owner()
        self._heartbeat: Heartbeat | None = None

    @property
    def jobs(self) -> BatchJobs:
        return BatchJobs(self.lazy_store.get().db)

    @property
    def claims(self) -> Claims:
        return self.jobs.claims(self.owner)

    # ------------------------------------------------------------------ control (event loop)
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._main(), name="unmask-batches")
        self._heartbeat = Heartbeat(lambda: self.claims.renew() if self._current else None, "unmask-batch-leases").start()

    async def stop(self) -> None:
        """Shutdown: in-flight lines are aborted unsaved (they run again after a restart)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def notify_threadsafe(self) -> None:
        """notify() from a thread-pool route."""
        loop = self._task.get_loop() if self._task is not None else None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.notify)

    def cancel(self, batch_id: str) -> dict:
        batch = self.jobs.update(batch_id, "cancelling", only_from=("validating", "in_progress"))
        if batch is None:
            return self.jobs.get(batch_id)
        if batch_id == self._current:
            self._stop_lines()
        self.notify()
        return self.jobs.get(batch_id)

    # ------------------------------------------------------------------ the loop
    async def _main(self) -> None:
        while self.app.state.serving is None:   # lines need the model; batches can be created before it loads
            if self.app.state.load_error:
                return
            await asyncio.sleep(0.1)
        self.app.state.serving.llm.engine.scheduler.background_slots = self.max_running
        while True:
            try:
                if self.lazy_store.exists:
                    await self._run_active()
            except StoreUnavailable as e:   # --database-url's server down: keep the runner, try again later
                logger.warning("batches: %s; retrying", e)
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_WAKE_S)
            except TimeoutError:
                pass
            self._wake.clear()

    async def _run_active(self) -> None:
        """Run every active batch this runner can claim, one after the other."""
        claims = self.claims
        claims.sweep()   # batches of a crashed process of this machine: free at once
        for batch_id in self.jobs.active():
            if not claims.claim(batch_id):   # another process runs it
                continue
            try:
                await self._process(batch_id)
            except asyncio.CancelledError:
                raise
            except ClaimLost:
                logger.warning("batch %s: another process took it over (this one's lease ran out)", batch_id)
            except StoreUnavailable:   # not the batch's fault: it stays in progress, and is resumed later
                raise
            except Exception:  # noqa: BLE001 - one batch's failure must not stop the others
                logger.exception("batch %s failed", batch_id)
                try:
                    self.jobs.update(batch_id, "failed", owner=self.owner, errors={"object": "list", "data": [
                        {"code": "server_error", "message": "internal server error", "param": None,
                         "line": None}]})
                except ClaimLost:
                    pass
            finally:
                claims.release(batch_id)

    async def _process(self, batch_id: str) -> None:
        self._current, self._halt = batch_id, False
        watch = asyncio.create_task(self._watch(batch_id))
        try:
            batch = self.jobs.get(batch_id)
            lines = await asyncio.to_thread(self._read_lines, batch)
            if isinstance(lines, ValidationIssue):   # the input file is gone: nothing left to run or finalize from
                self.jobs.update(batch_id, "failed", only_from=ACTIVE, owner=self.owner,
                                 errors={"object": "list", "data": [lines.to_api()]})
                return
            if batch["status"] == "validating":
                model = served_model(self.app, batch["endpoint"])
                issues = validate(lines, model)
                if not served(self.app, batch["endpoint"]):
                    issues.insert(0, ValidationIssue("unsupported_endpoint", f"this server does not serve "
                                                                             f"{batch['endpoint']}", param="endpoint"))
                if issues:
                    self.jobs.fail_validation(batch_id, issues, owner=self.owner)
                    return
                counts = {"total": len(lines), "completed": 0, "failed": 0}
                # None: cancelled while validating (then finalized as cancelled below)
                self.jobs.update(batch_id, "in_progress", only_from=("validating",), owner=self.owner,
                                 request_counts=counts, model=model)
            if self.jobs.get(batch_id)["status"] == "in_progress":
                await self._run_lines(batch, lines)
            status, owner = self.jobs.status(batch_id)
            if owner != self.owner:
                raise ClaimLost(f"batch {batch_id}")
            if status == "cancelling":
                await self._finalize(batch_id, lines, "cancelled", "batch_cancelled",
                                     "the batch was cancelled before this request ran")
            elif status == "in_progress" and time.time() >= batch["expires_at"]:
                await self._finalize(batch_id, lines, "expired", "batch_expired",
                                     "this request could not be executed before the completion window expired")
            elif status in ("in_progress", "finalizing"):
                self.jobs.update(batch_id, "finalizing", only_from=("in_progress",), owner=self.owner)
                await self._finalize(batch_id, lines, "completed")
        finally:
            watch.cancel()
            self._current, self._in_flight = None, set()

    async def _watch(self, batch_id: str) -> None:
        """Stops the batch's lines when it is cancelled through another process, or its claim was lost."""
        while True:
            await asyncio.sleep(WATCH_S)
            status, owner = self.jobs.status(batch_id)
            if status == "cancelling" or owner != self.owner:
                self._stop_lines()
                return

    def _stop_lines(self) -> None:
        self._halt = True
        for task in self._in_flight:
            task.cancel()

    def _read_lines(self, batch: dict) -> list[BatchLine] | ValidationIssue:
        try:
            data = self.lazy_store.get().files.read_bytes(batch["input_file_id"])
        except (FileNotFound, FileNotFoundError):
            return ValidationIssue("input_file_missing", f"the input file {batch['input_file_id']!r} was deleted "
                                                         "before the batch finished", param="input_file_id")
        return parse_lines(data.splitlines(), batch["endpoint"], self.max_line_bytes)

    async def _run_lines(self, batch: dict, lines: list[BatchLine]) -> None:
        jobs, batch_id = self.jobs, batch["id"]
        finished = jobs.finished_lines(batch_id)
        for line in lines:
            if self._halt or time.time() >= batch["expires_at"]:
                break
            if line.index in finished:
                continue
            if line.error is not None:   # fails alone, without the engine
                result = await self.caller.run(line)
                jobs.save_result(batch_id, line, False, result_record(line, result))
                continue
            while len(self._in_flight) >= self.max_inflight:
                done, _ = await asyncio.wait(self._in_flight, return_when=asyncio.FIRST_COMPLETED)
                self._in_flight -= done
            task = asyncio.create_task(self._run_line(batch_id, line))
            self._in_flight.add(task)
        if self._in_flight:
            await asyncio.wait(self._in_flight)

    async def _run_line(self, batch_id: str, line: BatchLine) -> None:
        while True:
            result = await self.caller.run(line)
            if result.status_code not in (429, 503):
                break
            await asyncio.sleep(RETRY_S)   # busy or restarting engine: not this line's failure
        self.jobs.save_result(batch_id, line, result.ok, result_record(line, result))

    async def _finalize(self, batch_id: str, lines: list[BatchLine], status: str, unrun_code: str | None = None,
                        unrun_message: str = "") -> None:
        """Write the output and error files from the saved results (in input order), then the final status."""
        jobs = self.jobs
        saved = {r.line: r for r in jobs.results(batch_id)}
        output, errors = [], []
        for line in lines:
            record = saved.get(line.index)
            if record is not None:
                (output if record.ok else errors).append(record.record)
            elif unrun_code is not None:
                errors.append(unrun_record(line, unrun_code, unrun_message))
            else:
                raise RuntimeError(f"batch {batch_id}: line {line.number} has no result at finalization")
        files = self.lazy_store.get().files

        def write(records: list[dict], kind: str) -> str | None:
            if not records:
                return None
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
            return files.create(data, f"{batch_id}_{kind}.jsonl", "batch_output", max_bytes=OUTPUT_MAX_BYTES).id

        output_id = await asyncio.to_thread(write, output, "output")
        error_id = await asyncio.to_thread(write, errors, "error")
        try:
            jobs.update(batch_id, status, owner=self.owner, output_file_id=output_id, error_file_id=error_id,
                        request_counts={"total": len(lines), "completed": len(output), "failed": len(errors)},
                        usage=batch_usage(output))
        except ClaimLost:   # another process finalizes it: these files are no batch's
            for file_id in filter(None, (output_id, error_id)):
                files.delete(file_id)
            raise
