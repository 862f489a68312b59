"""Labelled text for the classification walkthrough (issue 33 item 4): Debian's `fortunes` collections.

Each file of /usr/share/games/fortunes (Debian package `fortunes`, from fortune-mod 1.99.1; BSD licence, see
/usr/share/doc/fortunes/copyright) is one category, and its quotes are separated by lines holding only `%`
(the strfile(8) format). The labels are the collection's own file names: no one here wrote them.

    python bench/classification_data.py --out data/fortunes     # writes the files below
    python bench/classification_data.py --records mine.jsonl --out data/mine   # your own {"text", "label"} lines

Writes, into --out:
  train.jsonl, test.jsonl     {"id", "text", "label"}: a stratified split, seeded (--seed), test share --test-share
  sft-train.jsonl             chat records for `unmask finetune` (user: instruction + quote, assistant: label)
  batch-test.jsonl            Batch API lines for `unmask batch`, one per test quote, the label set as `choice`
  labels.json                 the labels, the sizes and the settings
Also usable as a module: `read_fortune_file`, `load_dataset`, `split`, `chat_record`, `batch_line`, `scores`.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

FORTUNE_DIR = Path("/usr/share/games/fortunes")
# topical files of the `fortunes` package (not the mixed ones: cookie, fortunes, miscellaneous, people, ...)
LABELS = ("computers", "education", "food", "law", "politics", "science", "sports")
MAX_CHARS = 600       # longer quotes are dropped (they would not fit the fine-tune's 256-token rows)
PER_LABEL = 300       # at most this many quotes per label (seeded sample), so that no file dominates
INSTRUCTION = "Which fortune file is this quote from? Answer with one of: {labels}.\n\n{text}"


def read_fortune_file(path: Path) -> list[str]:
    """The quotes of one strfile-format file: blocks separated by lines that are just '%'."""
    raw = path.read_bytes().decode("utf-8", errors="strict")
    quotes, cur = [], []
    for line in raw.splitlines():
        if line.strip() == "%":
            quotes.append("\n".join(cur).strip())
            cur = []
        else:
            cur.append(line)
    quotes.append("\n".join(cur).strip())
    return [q for q in quotes if q]


def load_dataset(directory: Path = FORTUNE_DIR, labels=LABELS, max_chars: int = MAX_CHARS,
                 per_label: int = PER_LABEL, seed: int = 0) -> list[dict]:
    """(text, label) records, duplicates removed (a quote in two files keeps neither: its label is ambiguous)."""
    missing = [lab for lab in labels if not (directory / lab).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} has no {', '.join(missing)} (Debian: apt-get install fortunes)")
    by_label = {lab: [q for q in read_fortune_file(directory / lab) if len(q) <= max_chars] for lab in labels}
    seen = Counter(q for qs in by_label.values() for q in set(qs))
    out = []
    rng = random.Random(seed)
    for lab in labels:
        qs = sorted({q for q in by_label[lab] if seen[q] == 1})
        rng.shuffle(qs)
        out += [{"text": q, "label": lab} for q in qs[:per_label]]
    return out


def split(records: list[dict], test_share: float = 0.2, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Stratified: each label's records shuffled with `seed`, the first round(share * n) of each go to test."""
    rng = random.Random(seed)
    train, test = [], []
    for lab in sorted({r["label"] for r in records}):
        rs = [r for r in records if r["label"] == lab]
        rng.shuffle(rs)
        k = round(test_share * len(rs))
        test += rs[:k]
        train += rs[k:]
    rng.shuffle(train)
    for prefix, part in (("train", train), ("test", test)):
        for i, r in enumerate(part):
            r["id"] = f"{prefix}-{i}"
    return train, test


def prompt(text: str, labels) -> str:
    return INSTRUCTION.format(labels=", ".join(labels), text=text)


def chat_record(rec: dict, labels) -> dict:
    """One SFT line (docs/training.md "Fine-tuning data"): the loss falls on the label and its stop token."""
    return {"messages": [{"role": "user", "content": prompt(rec["text"], labels)},
                         {"role": "assistant", "content": rec["label"]}]}


def batch_line(rec: dict, labels, custom_id: str | None = None, constraint: str = "choice") -> dict:
    """One Batch API line whose answer is forced to a label: the `choice` extension, or a json_schema enum."""
    body: dict = {"messages": [{"role": "user", "content": prompt(rec["text"], labels)}], "temperature": 0.0}
    if constraint == "choice":
        body.update(choice=list(labels), max_tokens=8)
    else:
        body.update(max_tokens=24, response_format={"type": "json_schema", "json_schema": {
            "name": "label", "strict": True, "schema": {"type": "object", "properties": {
                "label": {"type": "string", "enum": list(labels)}}, "required": ["label"],
                "additionalProperties": False}}})
    return {"custom_id": custom_id or rec["id"], "method": "POST", "url": "/v1/chat/completions", "body": body}


def answer_label(result: dict) -> str | None:
    """The label in one line of `unmask batch` output (choice text, or the json_schema object); None on error."""
    resp = result.get("response") or {}
    body = resp.get("body") if resp.get("status_code") == 200 else None
    if not body:
        return None
    content = (body["choices"][0]["message"].get("content") or "").strip()
    if content.startswith("{"):
        try:
            return json.loads(content).get("label")
        except (json.JSONDecodeError, AttributeError):
            return None
    return content


def scores(gold: list[str], pred: list[str | None], labels) -> dict:
    """Accuracy and macro-F1 (per label F1 = 2PR/(P+R), 0 where undefined; a missing prediction is wrong)."""
    if len(gold) != len(pred) or not gold:
        raise ValueError(f"{len(gold)} gold labels against {len(pred)} predictions")
    acc = sum(g == p for g, p in zip(gold, pred)) / len(gold)
    per = {}
    for lab in labels:
        tp = sum(g == lab and p == lab for g, p in zip(gold, pred))
        fp = sum(g != lab and p == lab for g, p in zip(gold, pred))
        fn = sum(g == lab and p != lab for g, p in zip(gold, pred))
        prec = tp / (tp + fp) if tp + fp else 0.0
        rec = tp / (tp + fn) if tp + fn else 0.0
        per[lab] = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    return {"accuracy": acc, "macro_f1": sum(per.values()) / len(per), "f1": per, "n": len(gold),
            "unanswered": sum(p is None for p in pred)}


def write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_records(path: Path, max_chars: int = MAX_CHARS) -> list[dict]:
    """A user's own data: JSONL lines {"text": str, "label": str}; texts over max_chars are dropped."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not (isinstance(rec, dict) and isinstance(rec.get("text"), str) and isinstance(rec.get("label"), str)
                and rec["label"].strip()):
            raise ValueError(f"{path}:{n}: expected {{\"text\": str, \"label\": non-empty str}}")
        if len(rec["text"]) <= max_chars:
            out.append({"text": rec["text"], "label": rec["label"]})
    if len({r["label"] for r in out}) < 2:
        raise ValueError(f"{path}: fewer than two labels among the texts of at most {max_chars} characters")
    return out


def prepare(out: Path, directory: Path = FORTUNE_DIR, seed: int = 0, test_share: float = 0.2,
            per_label: int = PER_LABEL, records: Path | None = None) -> dict:
    data = read_records(records) if records else load_dataset(directory, per_label=per_label, seed=seed)
    labels = sorted({r["label"] for r in data}) if records else list(LABELS)
    train, test = split(data, test_share, seed)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    write_jsonl(out / "sft-train.jsonl", (chat_record(r, labels) for r in train))
    write_jsonl(out / "batch-test.jsonl", (batch_line(r, labels) for r in test))
    source = str(records) if records else f"Debian package fortunes ({directory})"
    meta = {"source": source, "labels": labels, "seed": seed,
            "test_share": test_share, "max_chars": MAX_CHARS, "per_label": per_label,
            "train": dict(sorted(Counter(r["label"] for r in train).items())),
            "test": dict(sorted(Counter(r["label"] for r in test).items()))}
    (out / "labels.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/fortunes"))
    ap.add_argument("--fortunes", type=Path, default=FORTUNE_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-share", type=float, default=0.2)
    ap.add_argument("--per-label", type=int, default=PER_LABEL, help="fortunes only: quotes kept per label")
    ap.add_argument("--records", type=Path, help="your own JSONL of {\"text\", \"label\"} instead of fortunes")
    args = ap.parse_args()
    if not 0 < args.test_share < 1:
        sys.exit("error: --test-share must be between 0 and 1")
    try:
        meta = prepare(args.out, args.fortunes, args.seed, args.test_share, args.per_label, args.records)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
