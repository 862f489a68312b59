"""`unmask batch IN OUT` (unmask.batch.offline): results in input order, per-line errors as vLLM's run-batch
writes them, resuming a partial OUT, and one-line errors for bad input."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from unmask.batch.offline import run
from unmask.cli import app


def chat(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0.0, **body}}


def write(path, lines) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def read(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


LINES = [chat(f"c{i}", f"Item {i}.") for i in range(9)] + [
    chat("empty", "x", messages=[]), "{not json",
    {"custom_id": "cmp", "method": "POST", "url": "/v1/completions", "body": {"prompt": "def f(x):", "max_tokens": 4}},
    chat("other-model", "x", model="gpt-4o"),
]


def test_results_in_input_order_with_per_line_errors(tmp_path):
    write(tmp_path / "in.jsonl", LINES)
    summary = run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", max_num_seqs=4, progress=False)
    assert (summary.total, summary.succeeded, summary.failed, summary.skipped) == (13, 10, 3, 0)
    out = read(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in out] == [f"c{i}" for i in range(9)] + ["empty", None, "cmp", "other-model"]
    for r in out[:9]:
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert r["response"]["body"]["object"] == "chat.completion" and r["response"]["body"]["usage"]["completion_tokens"]
    assert out[11]["response"]["body"]["object"] == "text_completion"
    empty, garbled, other = out[9], out[10], out[12]
    assert empty["response"] == {"status_code": 400, "request_id": empty["response"]["request_id"], "body": None}
    assert empty["error"]["message"] == "messages must not be empty" and empty["error"]["param"] == "messages"
    assert "line 11 is not valid JSON" in garbled["error"]["message"]
    assert other["response"]["status_code"] == 404 and "gpt-4o" in other["error"]["message"]


def test_resumes_a_partial_output(tmp_path):
    write(tmp_path / "in.jsonl", LINES)
    run(tmp_path / "in.jsonl", tmp_path / "full.jsonl", max_num_seqs=4, progress=False)
    full = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    # a run killed after 5 lines, in the middle of writing the 6th
    (tmp_path / "out.jsonl").write_text("".join(full[:5]) + full[5][:40])
    summary = run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", max_num_seqs=4, progress=False)
    assert (summary.skipped, summary.succeeded + summary.failed) == (5, 8)
    out = (tmp_path / "out.jsonl").read_text().splitlines(keepends=True)
    assert out[:5] == full[:5]   # kept as they were
    assert [json.loads(x)["custom_id"] for x in out] == [json.loads(x)["custom_id"] for x in full]
    again = run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", max_num_seqs=4, progress=False)
    assert (again.skipped, again.succeeded + again.failed) == (13, 0)


@pytest.mark.parametrize("lines, message", [
    ([chat("a", "x"), chat("a", "y")], "custom_id 'a' is on lines 1 and 2"),
    (["", " "], "has no requests"),
])
def test_bad_input_is_one_line_error(tmp_path, lines, message):
    write(tmp_path / "in.jsonl", lines)
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")])
    assert result.exit_code == 1 and message in result.output and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_input_and_bad_output_are_one_line_errors(tmp_path):
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl")])
    assert result.exit_code == 1 and "does not exist" in result.output and result.output.count("\n") == 1
    write(tmp_path / "in.jsonl", [chat("a", "x")])
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in.jsonl"), str(tmp_path)])
    assert result.exit_code == 1 and "is a directory" in result.output
    (tmp_path / "out.jsonl").write_text('{"no": "custom_id"}\n')
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")])
    assert result.exit_code == 1 and "line 1 is not a batch result" in result.output


def test_cli_reports_counts_and_rate(tmp_path):
    write(tmp_path / "in.jsonl", [chat("a", "x"), chat("b", "y", messages=[])])
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                      "--max-num-seqs", "2"])
    assert result.exit_code == 0, result.output
    assert "1 succeeded, 1 failed, 0 already in" in result.output and "requests/s" in result.output
    assert [r["custom_id"] for r in read(tmp_path / "out.jsonl")] == ["a", "b"]


def test_embeddings_lines_load_the_embedding_model(tmp_path):
    write(tmp_path / "in.jsonl", [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                                   "body": {"model": "all-MiniLM-L6-v2", "input": "open a file"}}, chat("c", "Hi.")])
    summary = run(tmp_path / "in.jsonl", tmp_path / "out.jsonl", max_num_seqs=2, progress=False)
    assert (summary.succeeded, summary.failed) == (2, 0)
    embedded, chatted = read(tmp_path / "out.jsonl")
    assert len(embedded["response"]["body"]["data"][0]["embedding"]) == 384
    assert chatted["response"]["body"]["object"] == "chat.completion"
