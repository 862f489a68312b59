"""`unmask batch IN OUT --ray`: the offline batch runner (batch/offline.py) on a pool of engines with Ray Data.

The driver reads IN (JSONL, or Parquet with the columns custom_id, method, url, body: a struct or a JSON string),
checks it as `unmask batch` does and skips the lines a partial OUT already holds. The rest go through
`map_batches` to a pool of `--workers` actors, each holding one engine loaded as `unmask serve` loads it and
running its lines through the server's own routes (batch/execute.py): the same answers, the same per-line error
records. Ray Data keeps the input order, so the driver appends each result to OUT as it arrives, in order, and a
run that stops is resumed by running it again.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from unmask.batch.lines import BatchLine, parse_line, parse_lines, validate
from unmask.batch.offline import EMBEDDINGS, BatchInputError, Summary, _Progress, already_done, offline_record
from unmask.cluster import ClusterError

BODY_COLUMNS = ("custom_id", "method", "url", "body")
POOL_START_TIMEOUT_S = 600   # engines loading; a cluster without room for the pool fails after this
_CAUSE = re.compile(r"^[\w.]+(Error|Exception): ")


@dataclass
class RaySummary(Summary):
    nodes: int = 0          # cluster nodes whose engines answered lines


def read_lines(path: Path) -> list[str]:
    """The input's request lines as JSON text: a JSONL file's lines, or one per Parquet row."""
    if not path.is_file():
        raise BatchInputError(f"input file {path} does not exist" if not path.exists() else f"input {path} is not a file")
    if path.suffix.lower() != ".parquet":
        try:
            return path.read_bytes().decode("utf-8", errors="surrogateescape").splitlines()
        except OSError as e:
            raise BatchInputError(f"cannot read the input file {path}: {e.strerror}") from None
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is no Parquet
        raise BatchInputError(f"cannot read {path} as Parquet: {e}") from None
    missing = [c for c in BODY_COLUMNS if c not in table.column_names]
    if missing:
        raise BatchInputError(f"{path}: Parquet input needs the columns {', '.join(BODY_COLUMNS)}; "
                              f"missing {', '.join(missing)}")
    out = []
    for row in table.select(list(BODY_COLUMNS)).to_pylist():
        if isinstance(row["body"], str):   # a body stored as JSON text
            try:
                row["body"] = json.loads(row["body"])
            except json.JSONDecodeError:
                pass                       # left a string: that line's 400 names it
        out.append(json.dumps(row, ensure_ascii=False))
    return out


class EngineWorker:
    """One actor of the pool: an engine and the server's routes, answering a batch of lines at a time."""

    def __init__(self, model, max_num_seqs: int, dtype, device: str, max_line_bytes: int, threads: int,
                 need_embeddings: bool):
        import ray
        import torch

        from unmask.batch.execute import RouteCaller
        from unmask.batch.offline import load_app

        torch.set_num_threads(max(1, threads))
        self.app = load_app(model, max_num_seqs, dtype, device, need_embeddings)
        self.caller = RouteCaller(self.app)
        self.loop = asyncio.new_event_loop()
        self.max_line_bytes = max_line_bytes
        self.node = ray.get_runtime_context().get_node_id()

    async def _answer(self, lines: list[BatchLine]) -> list:
        return await asyncio.gather(*(self.caller.run(line) for line in lines))

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        lines = [parse_line(raw, int(i), int(n), None, self.max_line_bytes)
                 for raw, i, n in zip(batch["raw"], batch["index"], batch["number"])]
        results = self.loop.run_until_complete(self._answer(lines))
        records = [json.dumps(offline_record(line, r), ensure_ascii=False) for line, r in zip(lines, results)]
        return {"position": batch["position"], "record": np.array(records, dtype=object),
                "ok": np.array([r.ok for r in results]), "node": np.array([self.node] * len(lines), dtype=object)}


def run(input_path: Path, output_path: Path, model: Path | None = None, max_num_seqs: int = 64,
        dtype: str | None = None, device: str = "auto", max_line_bytes: int = 4 * 2**20, progress: bool = True,
        address: str | None = None, workers: int = 1, num_cpus: float = 1.0, num_gpus: float = 0.0) -> RaySummary:
    if input_path.resolve() == output_path.resolve():
        raise BatchInputError("the output file must not be the input file")
    raws = read_lines(input_path)
    kept = [(number, raw) for number, raw in enumerate(raws, start=1) if raw.strip()]
    lines = parse_lines(raws, None, max_line_bytes)
    issues = [i for i in validate(lines, model_name="") if i.code != "model_not_found"]
    if issues:
        raise BatchInputError(f"{input_path}: {issues[0].message}")
    done_ids, done_unnamed = already_done(output_path)
    todo: list[tuple[BatchLine, str]] = []
    for line, (_, raw) in zip(lines, kept):
        if line.custom_id is None and done_unnamed:
            done_unnamed -= 1
        elif line.custom_id is None or line.custom_id not in done_ids:
            todo.append((line, raw))
    if not todo:
        return RaySummary(len(lines), len(lines), 0, 0, 0.0)
    t0 = time.perf_counter()
    ok, failed, nodes = _run_pool(todo, output_path, len(lines), progress, address, workers, num_cpus, num_gpus,
                                  dict(model=model, max_num_seqs=max_num_seqs, dtype=dtype, device=device,
                                       max_line_bytes=max_line_bytes, threads=max(1, int(num_cpus)),
                                       need_embeddings=any(line.url == EMBEDDINGS for line, _ in todo)))
    return RaySummary(len(lines), len(lines) - len(todo), ok, failed, time.perf_counter() - t0, nodes)


def _run_pool(todo, output_path: Path, total: int, progress: bool, address, workers: int, num_cpus: float,
              num_gpus: float, worker_kwargs: dict) -> tuple[int, int, int]:
    from unmask.cluster import launch

    started = launch.connect(address)
    import ray
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True      # results come back in input order: OUT is written in order
    ctx.enable_progress_bars = False
    ctx.wait_for_min_actors_s = POOL_START_TIMEOUT_S  # the whole pool up before the first batch: work spreads over it
    batch_size = 2 * worker_kwargs["max_num_seqs"]  # as the offline runner: twice the engine's slots in flight
    rows = [{"position": k, "index": line.index, "number": line.number, "raw": raw}
            for k, (line, raw) in enumerate(todo)]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // batch_size)))
    ds = ds.map_batches(EngineWorker, fn_constructor_kwargs=worker_kwargs, batch_size=batch_size,
                        compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=1), num_cpus=num_cpus, num_gpus=num_gpus or None)
    ok = failed = 0
    nodes: set[str] = set()
    bar = _Progress(total, total - len(todo)) if progress else None
    t0 = time.perf_counter()
    try:
        with open(output_path, "a", encoding="utf-8") as out:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                for record, good, node in zip(batch["record"], batch["ok"], batch["node"]):
                    out.write(record + "\n")
                    ok, failed = ok + bool(good), failed + (not good)
                    nodes.add(node)
                out.flush()
                if bar is not None:
                    bar.update(ok + failed, time.perf_counter() - t0)
            os.fsync(out.fileno())
    except (ray.exceptions.RayError, RuntimeError) as e:
        raise ClusterError(f"the batch stopped on the cluster after {ok + failed} lines (run it again to resume): "
                           f"{_first_line(e)}") from None
    finally:
        if bar is not None:
            bar.stop()
        if started:
            ray.shutdown()
    return ok, failed, len(nodes)


def _first_line(e: BaseException) -> str:
    """The user-facing cause in a Ray traceback: its last `SomeError: message` line."""
    causes = [line.strip() for line in str(e).splitlines() if _CAUSE.match(line.strip())]
    return causes[-1] if causes else type(e).__name__
