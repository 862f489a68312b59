"""scripts/device_distill.py: the comparison behind the shipping rule, and the whole one-call run on this CPU
(--quick, a tiny model), so a lent GPU's minutes are not spent finding a renamed flag."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import CHAT, FIM, tiny_cfg, tokdir, write_corpus  # noqa: F401 (tokdir: a fixture)
from unmask.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
TEXT = "def add(a, b):\n    return a + b\n\nthe cat sat on the mat.\nthe dog ate the bone.\n"  # prompts are cut at line ends


def _script():
    spec = importlib.util.spec_from_file_location("device_distill", ROOT / "scripts" / "device_distill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report(tpf: float, acc: float, repeat: float) -> dict:
    return {"tasks": [
        {"task": "next_line", "policy": "speculative_b4_lookup", "accuracy": acc, "edit_similarity": 0.5,
         "valid": None, "repeat": None, "tokens_per_forward": tpf},
        {"task": "function", "policy": "speculative_b4_lookup", "accuracy": 0.1, "edit_similarity": 0.3,
         "valid": 0.8, "repeat": repeat, "tokens_per_forward": tpf + 0.5},
    ]}


def test_compare_ships_only_at_three_tokens_per_forward_with_no_score_worse():
    compare = _script().compare
    base = _report(2.3, 0.20, 0.30)
    better = compare(base, _report(3.1, 0.20, 0.30))
    assert better["ships"] and better["scores_at_least_base"] and better["meets_tokens_per_forward"]
    assert better["default_tokens_per_forward"] == {"next_line": 3.1, "function": 3.6}
    slow = compare(base, _report(2.9, 0.25, 0.30))  # better scores, but next lines under 3 tokens per forward
    assert slow["scores_at_least_base"] and not slow["meets_tokens_per_forward"] and not slow["ships"]
    worse = compare(base, _report(3.5, 0.15, 0.40))  # fast, but exact match fell and the repeat rate rose
    assert not worse["ships"]
    by_task = {e["task"]: e for e in worse["table"]}
    assert by_task["next_line"]["worse"] == ["accuracy"] and by_task["function"]["worse"] == ["repeat"]
    assert by_task["next_line"]["accuracy"] == [0.20, 0.15]


@pytest.mark.parametrize("draft_adapter", [0, 4])  # 4: the base frozen, a draft adapter trained
def test_quick_run_distils_evaluates_and_packages(tmp_path, tokdir, draft_adapter):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus", TEXT * 10, n=6)  # the eval loss needs a 512-token held-out row
    chat = tmp_path / "chat.jsonl"
    chat.write_text((json.dumps(CHAT) + "\n" + json.dumps(FIM) + "\n") * 4)
    base = train(tiny_cfg(tmp_path / "base", total_steps=2, seq_len=64), corpus, tokdir).model_dir
    out, runs = tmp_path / "out", tmp_path / "runs"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_distill.py"), "--quick", "--model", str(base),
                        "--out", str(out), "--runs", str(runs), "--data", str(corpus), "--chat", str(chat),
                        "--sft-heldout", str(chat), "--draft-adapter", str(draft_adapter)], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["calibrate"]["steps"] == 2 and summary["distill"]["steps"] == 3
    # the distillation read the calibration's cached answers: the teacher ran once
    assert "shard 1/" not in (runs / "logs" / "distill.log").read_text()
    assert "shard 1/" in (runs / "logs" / "calibrate.log").read_text()
    assert summary["compute"]["teacher"]["answer_tokens"] > 0
    rows = summary["comparison"]["table"]
    assert {r["policy"] for r in rows} == {"speculative_b4_lookup", "speculative_b4", "threshold_0.9"}
    assert all(len(r["tokens_per_forward"]) == 2 for r in rows)
    shards = summary["shards"]
    assert shards and all((out / s).is_file() for s in shards) and (out / "meta.tar.gz").is_file()
    assert len(list(out.iterdir())) <= 8  # what one device call brings back
    joined = tmp_path / "joined"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "device_distill.py"), "--join", str(out), "--to",
                    str(joined)], check=True, capture_output=True, cwd=ROOT, timeout=120)
    from unmask.models.loader import load_model

    model, _ = load_model(joined, dtype="float32", device="cpu")
    assert (model.draft_gate is not None) == bool(draft_adapter)


def test_a_model_directory_without_config_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_distill.py"), "--model", str(tmp_path),
                        "--quick"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 2 and "no config.json there" in p.stderr.strip().splitlines()[-1]
