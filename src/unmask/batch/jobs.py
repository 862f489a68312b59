"""Batch jobs in the store's SQLite database: the API object (as JSON, with `status` beside it for queries) and
one row per finished line, which is what makes a batch resumable: a line with a row is never run again, and the
output and error files are written from the rows, each custom_id exactly once.
"""
from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass

from unmask.batch.execute import LineResult
from unmask.batch.lines import BatchLine, ValidationIssue
from unmask.store import Database
from unmask.store.claims import ClaimLost, Claims

COMPLETION_WINDOW_S = {"24h": 24 * 3600}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")   # the runner's work
TIMESTAMPS = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
              "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
              "cancelled": "cancelled_at"}


class BatchNotFound(LookupError):
    def __init__(self, batch_id: str):
        super().__init__(f"no batch with id {batch_id!r}")


@dataclass
class LineRecord:
    line: int
    custom_id: str | None
    ok: bool
    record: dict


def result_record(line: BatchLine, result: LineResult) -> dict:
    """An output / error file line as OpenAI writes it."""
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id,
            "response": {"status_code": result.status_code, "request_id": result.request_id, "body": result.body},
            "error": None}


def batch_usage(records: list[dict]) -> dict:
    """OpenAI's Batch `usage`: the tokens of the successful requests, summed over the endpoints' usage shapes
    (prompt/completion tokens of chat and completions and embeddings, input/output tokens of responses)."""
    tokens_in = tokens_out = 0
    for record in records:
        usage = ((record.get("response") or {}).get("body") or {}).get("usage") or {}
        tokens_in += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        tokens_out += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    return {"input_tokens": tokens_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": tokens_out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": tokens_in + tokens_out}


def unrun_record(line: BatchLine, code: str, message: str) -> dict:
    """An error file line for a request that never ran (the batch was cancelled or expired first)."""
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}


class BatchJobs:
    def __init__(self, db: Database):
        self.db = db

    def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None,
               model: str | None) -> dict:
        now = int(time.time())
        batch = {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": endpoint, "model": model,
                 "errors": None, "input_file_id": input_file_id, "completion_window": completion_window,
                 "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
                 "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S[completion_window],
                 "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
                 "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}
        self.db.conn.execute("INSERT INTO batches (id, status, object) VALUES (?, ?, ?)",
                             (batch["id"], batch["status"], json.dumps(batch)))
        return batch

    def get(self, batch_id: str) -> dict:
        row = self.db.conn.execute("SELECT object FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise BatchNotFound(batch_id)
        batch = json.loads(row[0])
        if batch["status"] in ("in_progress", "cancelling", "finalizing"):
            batch["request_counts"] = self.counts(batch_id, batch["request_counts"]["total"])
        return batch

    def list(self, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """Newest first; `after` is the id the previous page ended with."""
        args: tuple = ()
        where = ""
        if after is not None:
            row = self.db.conn.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
            if row is None:
                raise BatchNotFound(after)
            where, args = "WHERE seq < ?", (row[0],)
        rows = self.db.conn.execute(f"SELECT id FROM batches {where} ORDER BY seq DESC LIMIT ?",
                                    (*args, limit + 1)).fetchall()
        return [self.get(r[0]) for r in rows[:limit]], len(rows) > limit

    def active(self) -> list[str]:
        marks = ",".join("?" * len(ACTIVE))
        return [r[0] for r in self.db.conn.execute(
            f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE)]

    def claims(self, owner: str | None = None) -> Claims:
        """Claims on batches (a runner runs only the batches it holds; store/claims.py)."""
        return Claims(lambda: self.db.conn, "batches", "id", owner)

    def status(self, batch_id: str) -> tuple[str, str | None]:
        """(status, owner) of a batch, read without parsing its object (the runner polls it)."""
        row = self.db.conn.execute("SELECT status, owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise BatchNotFound(batch_id)
        return row[0], row[1]

    def update(self, batch_id: str, status: str | None = None, only_from: tuple[str, ...] | None = None,
               owner: str | None = None, **fields) -> dict | None:
        """Set fields (and `status` with its timestamp) in one transaction; with `only_from`, only when the
        current status is one of those (None returned otherwise): a cancel never overwrites a finished batch.
        With `owner`, only while that owner holds the batch's claim (store/claims.py; ClaimLost otherwise): a
        runner whose lease another took changes nothing."""
        with self.db.transaction() as conn:
            row = conn.execute("SELECT object, owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                raise BatchNotFound(batch_id)
            if owner is not None and row[1] != owner:
                raise ClaimLost(f"batch {batch_id}")
            batch = json.loads(row[0])
            if only_from is not None and batch["status"] not in only_from:
                return None
            batch.update(fields)
            if status is not None:
                batch["status"] = status
                if status in TIMESTAMPS:
                    batch[TIMESTAMPS[status]] = int(time.time())
            conn.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?",
                         (batch["status"], json.dumps(batch), batch_id))
        return batch

    def fail_validation(self, batch_id: str, issues: list[ValidationIssue], owner: str | None = None) -> dict | None:
        return self.update(batch_id, "failed", only_from=("validating",), owner=owner,
                           errors={"object": "list", "data": [i.to_api() for i in issues]})

    # ------------------------------------------------------------------ line results
    def save_result(self, batch_id: str, line: BatchLine, ok: bool, record: dict) -> None:
        """A finished line, durable once this returns; a second result for the same line is ignored."""
        self.db.conn.execute("INSERT OR IGNORE INTO batch_results (batch_id, line, custom_id, ok, record) "
                             "VALUES (?, ?, ?, ?, ?)", (batch_id, line.index, line.custom_id, int(ok),
                                                        json.dumps(record)))

    def finished_lines(self, batch_id: str) -> set[int]:
        return {r[0] for r in self.db.conn.execute("SELECT line FROM batch_results WHERE batch_id = ?", (batch_id,))}

    def results(self, batch_id: str) -> list[LineRecord]:
        return [LineRecord(r[0], r[1], bool(r[2]), json.loads(r[3])) for r in self.db.conn.execute(
            "SELECT line, custom_id, ok, record FROM batch_results WHERE batch_id = ? ORDER BY line", (batch_id,))]

    def counts(self, batch_id: str, total: int) -> dict:
        ok = dict(self.db.conn.execute("SELECT ok, COUNT(*) FROM batch_results WHERE batch_id = ? GROUP BY ok",
                                       (batch_id,)).fetchall())
        return {"total": total, "completed": ok.get(1, 0), "failed": ok.get(0, 0)}
