"""The classification walkthrough's converter and scorer (bench/classification_data.py; issue 33 item 4)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import classification_data as cd  # noqa: E402


def write_fortunes(d: Path, files: dict[str, list[str]]) -> Path:
    d.mkdir()
    for name, quotes in files.items():
        (d / name).write_text("\n%\n".join(quotes) + "\n%\n", encoding="utf-8")
    return d


def test_read_fortune_file_splits_on_percent_lines(tmp_path):
    p = tmp_path / "f"
    p.write_text("First line\n\tsecond line\n%\n\n%\nA 50% chance\n  -- someone\n%\nlast, no trailing percent\n")
    assert cd.read_fortune_file(p) == ["First line\n\tsecond line", "A 50% chance\n  -- someone",
                                       "last, no trailing percent"]


def test_scores_accuracy_and_macro_f1():
    gold = ["a", "a", "a", "b", "b", "c"]
    pred = ["a", "a", "b", "b", None, "a"]
    s = cd.scores(gold, pred, ("a", "b", "c"))
    assert s["accuracy"] == pytest.approx(3 / 6)
    # a: P 2/3 R 2/3 -> 2/3; b: P 1/2 R 1/2 -> 1/2; c: no true positive -> 0
    assert s["f1"] == pytest.approx({"a": 2 / 3, "b": 0.5, "c": 0.0})
    assert s["macro_f1"] == pytest.approx((2 / 3 + 0.5) / 3)
    assert s["unanswered"] == 1 and s["n"] == 6
    with pytest.raises(ValueError):
        cd.scores(["a"], [], ("a",))


def test_split_is_stratified_seeded_and_disjoint(tmp_path):
    files = {"x": [f"x quote {i}" for i in range(10)], "y": [f"y quote {i}" for i in range(5)],
             "z": ["shared", "z only", "too long " * 100]}
    files["y"].append("shared")  # in two files: dropped, its label is ambiguous
    d = write_fortunes(tmp_path / "f", files)
    recs = cd.load_dataset(d, labels=("x", "y", "z"), per_label=8, seed=1)
    by = {lab: [r["text"] for r in recs if r["label"] == lab] for lab in "xyz"}
    assert len(by["x"]) == 8 and sorted(by["y"]) == [f"y quote {i}" for i in range(5)] and by["z"] == ["z only"]
    train, test = cd.split(recs, test_share=0.2, seed=1)
    assert sorted(r["label"] for r in test) == ["x", "x", "y"]      # round(0.2 * 8), round(0.2 * 5), round(0.2 * 1)
    assert len(train) == 11 and not {r["text"] for r in train} & {r["text"] for r in test}
    again_train, again_test = cd.split(cd.load_dataset(d, labels=("x", "y", "z"), per_label=8, seed=1), 0.2, 1)
    assert again_test == test and again_train == train
    assert [r["id"] for r in test] == ["test-0", "test-1", "test-2"]


def test_chat_record_and_batch_line_and_answer_label():
    rec = {"id": "test-3", "text": "Never trust a computer you can't lift.", "label": "computers"}
    chat = cd.chat_record(rec, ("computers", "food"))
    assert chat["messages"][1] == {"role": "assistant", "content": "computers"}
    assert chat["messages"][0]["content"].endswith("one of: computers, food.\n\nNever trust a computer you can't lift.")
    line = cd.batch_line(rec, ("computers", "food"))
    assert line["custom_id"] == "test-3" and line["url"] == "/v1/chat/completions"
    assert line["body"]["choice"] == ["computers", "food"]
    js = cd.batch_line(rec, ("computers", "food"), "c9", constraint="json_schema")
    assert js["custom_id"] == "c9"
    assert js["body"]["response_format"]["json_schema"]["schema"]["properties"]["label"]["enum"] == ["computers", "food"]

    def result(status, content):
        return {"custom_id": "x", "response": {"status_code": status, "body": {
            "choices": [{"message": {"role": "assistant", "content": content}}]} if status == 200 else None}}

    assert cd.answer_label(result(200, "food")) == "food"
    assert cd.answer_label(result(200, '{"label": "computers"}')) == "computers"
    assert cd.answer_label(result(200, '{"label": ')) is None
    assert cd.answer_label(result(400, None)) is None


def test_prepare_writes_finetune_and_batch_files(tmp_path):
    files = {lab: [f"{lab} quote number {i}" for i in range(10)] for lab in cd.LABELS}
    d = write_fortunes(tmp_path / "f", files)
    meta = cd.prepare(tmp_path / "out", d, seed=0, test_share=0.2)
    assert meta["train"] == {lab: 8 for lab in cd.LABELS} and meta["test"] == {lab: 2 for lab in cd.LABELS}
    sft = cd.read_jsonl(tmp_path / "out" / "sft-train.jsonl")
    batch = cd.read_jsonl(tmp_path / "out" / "batch-test.jsonl")
    test = cd.read_jsonl(tmp_path / "out" / "test.jsonl")
    assert len(sft) == 56 and len(batch) == 14 == len(test)
    assert [b["custom_id"] for b in batch] == [t["id"] for t in test]
    assert json.loads((tmp_path / "out" / "labels.json").read_text())["labels"] == list(cd.LABELS)


def test_missing_collection_is_named(tmp_path):
    d = write_fortunes(tmp_path / "f", {"computers": ["q"]})
    with pytest.raises(FileNotFoundError, match="apt-get install fortunes"):
        cd.load_dataset(d)


@pytest.mark.skipif(not (cd.FORTUNE_DIR / "computers").is_file(),
                    reason="Debian's fortunes collections are not installed (apt-get install fortunes; make setup as root)")
def test_real_collections_give_the_documented_split(tmp_path):
    meta = cd.prepare(tmp_path / "out")
    assert meta["train"] == {"computers": 240, "education": 149, "food": 146, "law": 146, "politics": 240,
                             "science": 240, "sports": 106}
    assert sum(meta["test"].values()) == 316


def test_own_records_become_the_same_files(tmp_path):
    src = tmp_path / "mine.jsonl"
    rows = [{"text": f"great product {i}", "label": "positive"} for i in range(5)]
    rows += [{"text": f"broke in a week {i}", "label": "negative"} for i in range(5)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    meta = cd.prepare(tmp_path / "out", records=src, test_share=0.4)
    assert meta["labels"] == ["negative", "positive"] and meta["test"] == {"negative": 2, "positive": 2}
    line = cd.read_jsonl(tmp_path / "out" / "batch-test.jsonl")[0]
    assert line["body"]["choice"] == ["negative", "positive"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "label": "a"}\n{"text": "y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        cd.read_records(bad)
    bad.write_text('{"text": "x", "label": "a"}\n')
    with pytest.raises(ValueError, match="fewer than two labels"):
        cd.read_records(bad)
