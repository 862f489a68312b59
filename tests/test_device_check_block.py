"""scripts/device_check.py --part block (issue 31's prepared GPU check) in its tiny mode on the CPU, so the
script a lent GPU runs once cannot rot: every section runs, the dense shape's and the MoE shape's (weights drawn
on the device, scripts/device_check_moe.py), and the JSON and the table come out."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_block_device_check_runs_in_tiny_mode(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import device_check

    device_check.main(["--part", "block", "--tiny", "--device", "cpu", "--out", str(tmp_path),
                       "--batches", "2", "--prompt-len", "8", "--max-tokens", "8"])
    report = json.loads((tmp_path / "block_check.json").read_text())
    assert "errors" not in report
    rows = report["unmask"]
    assert {(r["static"], r["mode"]) for r in rows} == {
        (s, m) for s in (True, False) for m in ("topk1", "topk2", "topk4", "topk8", "threshold0.9", "sample0.8")}
    assert all(r["tokens"] == 2 * 8 for r in rows)  # EOS ignored: every request writes max_tokens
    assert [r["tokens_per_forward"] for r in rows if r["static"] and r["mode"].startswith("topk")] == [1, 2, 4, 8]
    assert report["host_syncs"]["static"]["host_reads_per_step"] == 1
    assert report["host_syncs"]["eager"]["host_reads_per_step"] > 1
    hf = report["transformers"]
    assert hf["rows"][0]["cache"] == "dynamic" and hf["rows"][0]["tokens"] == 16
    assert hf["rows"][-1] == {"cache": "static+compile", "batch": 1, "skipped": "--tiny"}
    moe = report["moe"]
    assert {(r["static"], r["mode"]) for r in moe} == {(True, "topk1"), (True, "topk4"), (True, "threshold0.9"),
                                                       (False, "topk4")}
    assert all(r["tokens"] == 2 * 8 for r in moe) and report["moe_identity"]["of"] == 2
    assert report["moe_shape"]["name"] == "tiny" and report["moe_shape"]["parameters"] > 0
    # the MoE's grouped GEMMs read nothing back in the static step; its eager loop reads the chosen experts
    assert report["moe_host_syncs"]["static"]["host_reads_per_step"] == 1
    assert report["moe_host_syncs"]["eager"]["host_reads_per_step"] > 2
    for key in ("host_time", "moe_host_time"):  # one row per batch size (here the one, 2)
        (t,) = report[key]
        assert t["batch"] == 2 and t["steps"] >= 1 and t["plan"] > 0 and t["commit"] > 0 and t["wait"] >= 0
        assert t["ms_per_step"] == pytest.approx(sum(t[k] for k in ("plan", "stage", "wait", "read", "commit", "rest")))
        assert t["staged"] == 0.5  # the second of each request's two steps: inputs the device advanced itself
    # the identity covers the greedy modes (sampled runs draw from other generators on each path)
    assert report["identity"] == {**report["identity"], "identical_requests": 2 * 5, "of": 2 * 5}
    md = (tmp_path / "block_check.md").read_text()
    assert "| unmask static step | 2 | topk4 |" in md and "transformers" in md and "## tiny MoE shape" in md
