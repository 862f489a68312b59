"""`unmask batch IN.jsonl OUT.jsonl`: the Batch API's line format run offline, with no server and no HTTP.

The model is loaded as `unmask serve` loads it and each line goes through the same route code in this process
(execute.py), so answers and per-line errors are the server's. Up to twice --max-num-seqs lines are in flight,
so that the engine's waiting queue refills every slot that frees up. Results are written in input order, one
JSON line each as vLLM's run-batch writes them: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`, with `body` null and `error` the error object for a failed line. An OUT that a previous run
left partial is resumed: lines whose custom_id is already there are skipped (a torn last line is dropped).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from unmask.batch.execute import LineResult, RouteCaller
from unmask.batch.jobs import result_record
from unmask.batch.lines import BatchLine, parse_lines, validate
from unmask.errors import UnmaskError

EMBEDDINGS = "/v1/embeddings"


class BatchInputError(UnmaskError):
    """The input or output file cannot be used (the CLI prints it in one line)."""


@dataclass
class Summary:
    total: int
    skipped: int        # already in OUT
    succeeded: int
    failed: int
    seconds: float

    @property
    def requests_per_s(self) -> float:
        return (self.succeeded + self.failed) / self.seconds if self.seconds else 0.0


def offline_record(line: BatchLine, result: LineResult) -> dict:
    if result.ok:
        return result_record(line, result)
    error = result.body.get("error") if isinstance(result.body, dict) else None
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id,
            "response": {"status_code": result.status_code, "request_id": result.request_id, "body": None},
            "error": error or {"message": str(result.body), "type": "server_error", "param": None, "code": None}}


def read_input(path: Path, max_line_bytes: int) -> list[BatchLine]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BatchInputError(f"input file {path} does not exist") from None
    except OSError as e:
        raise BatchInputError(f"cannot read the input file {path}: {e.strerror}") from None
    lines = parse_lines(data.splitlines(), None, max_line_bytes)
    issues = [i for i in validate(lines, model_name="") if i.code != "model_not_found"]  # a model: that line's 404
    if issues:
        raise BatchInputError(f"{path}: {issues[0].message}")
    return lines


def already_done(path: Path) -> tuple[set[str], int]:
    """custom_ids of the complete records in a partial OUT and the count of those without one (unreadable lines);
    a torn last line (a run killed mid-write) is cut off the file."""
    if not path.exists():
        return set(), 0
    if path.is_dir():
        raise BatchInputError(f"output {path} is a directory")
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    ids, unnamed = set(), 0
    for number, raw in enumerate(data[:keep].splitlines(), start=1):
        try:
            record = json.loads(raw)
            custom_id = record["custom_id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise BatchInputError(f"output {path} line {number} is not a batch result; pass another OUT") from None
        if custom_id is None:
            unnamed += 1
        else:
            ids.add(custom_id)
    return ids, unnamed


def load_app(model: Path | None, max_num_seqs: int, dtype: str | None, device: str, need_embeddings: bool):
    """The server's app, loaded synchronously: routes, error handlers and the serving objects (no socket)."""
    from unmask.defaults import default_model_path
    from unmask.server.app import ServerArgs, create_app, load_serving
    from unmask.server.cli import default_served_name

    path = model if model is not None else default_model_path()
    if not path.is_dir():
        raise BatchInputError(f"model directory {path} does not exist")
    args = ServerArgs(model=path, served_model_name=default_served_name(path), max_num_seqs=max_num_seqs,
                      max_queue=sys.maxsize // 4, dtype=dtype, device=device)
    app = create_app(args)
    load_serving(app, args)
    if app.state.load_error:
        raise BatchInputError(app.state.load_error)
    from unmask.retrieval import routes as retrieval

    # the routes read the retrieval state (embeddings, file_search): the embedding model loads only when a line
    # needs it
    retrieval.start(app, None if need_embeddings else "off")
    while retrieval.loading(app.state):
        time.sleep(0.05)
    return app


def run(input_path: Path, output_path: Path, model: Path | None = None, max_num_seqs: int = 64,
        dtype: str | None = None, device: str = "auto", max_line_bytes: int = 4 * 2**20,
        progress: bool = True) -> Summary:
    if input_path.resolve() == output_path.resolve():
        raise BatchInputError("the output file must not be the input file")
    lines = read_input(input_path, max_line_bytes)
    done_ids, done_unnamed = already_done(output_path)
    todo = []
    for line in lines:
        if line.custom_id is None and done_unnamed:
            done_unnamed -= 1
        elif line.custom_id is None or line.custom_id not in done_ids:
            todo.append(line)
    t0 = time.perf_counter()
    if not todo:
        return Summary(len(lines), len(lines), 0, 0, 0.0)
    app = load_app(model, max_num_seqs, dtype, device, any(line.url == EMBEDDINGS for line in todo))
    try:
        with open(output_path, "a", encoding="utf-8") as out:
            ok, failed, seconds = asyncio.run(_drive(app, todo, out, 2 * max_num_seqs, len(lines), progress))
    finally:
        app.state.serving.engine.shutdown(drain=False)
    return Summary(len(lines), len(lines) - len(todo), ok, failed, seconds or time.perf_counter() - t0)


async def _drive(app, todo: list[BatchLine], out, in_flight: int, total: int, progress: bool) -> tuple[int, int, float]:
    """Run `todo` with at most `in_flight` lines at once; write each result once every earlier one is written."""
    caller = RouteCaller(app)
    results: dict[int, LineResult] = {}
    next_write, ok, failed = 0, 0, 0
    t0 = time.perf_counter()
    bar = _Progress(total, total - len(todo)) if progress else None
    pending: set[asyncio.Task] = set()
    launched = 0

    async def one(position: int, line: BatchLine) -> None:
        results[position] = await caller.run(line)

    try:
        while next_write < len(todo):
            while launched < len(todo) and len(pending) < in_flight:
                pending.add(asyncio.create_task(one(launched, todo[launched])))
                launched += 1
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()   # an exception here is a bug: let it surface
            while next_write in results:
                result = results.pop(next_write)
                out.write(json.dumps(offline_record(todo[next_write], result), ensure_ascii=False) + "\n")
                ok, failed = ok + result.ok, failed + (not result.ok)
                next_write += 1
            out.flush()
            if bar is not None:
                bar.update(ok + failed, time.perf_counter() - t0)
        os.fsync(out.fileno())
    finally:
        for task in pending:
            task.cancel()
        if bar is not None:
            bar.stop()
    return ok, failed, time.perf_counter() - t0


class _Progress:
    """A rich progress bar: requests done of all, requests/s of this run, elapsed time and ETA."""

    def __init__(self, total: int, skipped: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.skipped = skipped
        self.bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]:.2f} requests/s"), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn())
        self.task = self.bar.add_task("batch", total=total, completed=skipped, rate=0.0)
        self.bar.start()

    def update(self, finished: int, elapsed: float) -> None:
        self.bar.update(self.task, completed=self.skipped + finished, rate=finished / elapsed if elapsed else 0.0)

    def stop(self) -> None:
        self.bar.stop()
