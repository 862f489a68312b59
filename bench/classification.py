"""Classification end to end on real data (issue 33 item 4): accuracy, macro-F1 and items/s of a fine-tuned unmask
model through `unmask batch` (labels forced by `choice`), beside the fine-tuned AR twin and TF-IDF + logistic
regression, on the same held-out split of Debian's `fortunes` (bench/classification_data.py).

    python bench/classification.py --model runs/cls-fortunes-100/model --twin runs/cls-fortunes-twin100/model \
        --threads 1 --json docs/bench/classification/fortunes-100-steps.json

Sections: `tfidf` (scikit-learn, trained on train.jsonl), `unmask` (`unmask batch` as a subprocess on
batch-test.jsonl, OMP_NUM_THREADS=--threads), `twin` (bench/classification_twin.py, in this process, torch threads
=--threads), and, with --speed-lines N, the held-out lines repeated to N lines (custom_ids made unique) through
`unmask batch` and, with --server, at the same time through `unmask serve`'s /v1/batches (bench/batch_pipeline.py's
Server; both at once, so that on a shared machine both see the same load). The
items/s of `unmask batch` are the runner's own (its last line; model load excluded), as are the server's (from the
batch's creation to its completion). Prints one JSON object; --json writes it too.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import classification_data as cd  # noqa: E402
from benchlib.common import write_json  # noqa: E402


def tfidf(train: list[dict], test: list[dict], labels, repeat_to: int = 0) -> dict:
    """Word 1-2 grams, sublinear tf, logistic regression at scikit-learn's defaults otherwise (C=1): no tuning."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    clf = make_pipeline(TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True), LogisticRegression(max_iter=2000))
    t0 = time.perf_counter()
    clf.fit([r["text"] for r in train], [r["label"] for r in train])
    fit_s = time.perf_counter() - t0
    texts = [r["text"] for r in test]
    t0 = time.perf_counter()
    pred = list(clf.predict(texts))
    out = {**cd.scores([r["label"] for r in test], pred, labels), "fit_s": fit_s,
           "items_per_s": len(texts) / (time.perf_counter() - t0)}
    if repeat_to:
        many = (texts * (repeat_to // len(texts) + 1))[:repeat_to]
        t0 = time.perf_counter()
        clf.predict(many)
        out["speed_items_per_s"] = repeat_to / (time.perf_counter() - t0)
    return out


def run_batch(model: Path, inp: Path, out: Path, threads: int, max_num_seqs: int) -> tuple[float, float]:
    """`unmask batch` in a subprocess: (the runner's own requests/s, wall seconds including the model load)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "unmask.cli", "batch", str(inp), str(out), "--model", str(model),
                        "--max-num-seqs", str(max_num_seqs), "--no-progress"], env=env, capture_output=True,
                       text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"error: unmask batch failed: {p.stderr.strip().splitlines()[-1:]}")
    # last line: "N succeeded, N failed, N already in OUT, of N; R requests/s"
    return float(p.stderr.strip().splitlines()[-1].split("; ")[-1].split()[0]), wall


def predictions(out: Path) -> dict[str, str | None]:
    return {r["custom_id"]: cd.answer_label(r) for r in cd.read_jsonl(out)}


def server_items_per_s(model: Path, inp: Path, threads: int, max_num_seqs: int, tmp: Path) -> tuple[float, int]:
    from batch_pipeline import Server

    os.environ["OMP_NUM_THREADS"] = str(threads)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = Server(tmp / "server-data", port, "--model", str(model), "--max-num-seqs", str(max_num_seqs))
    try:
        t0 = time.perf_counter()
        b = server.wait(server.batch(inp).id)
        return b.request_counts.completed / (time.perf_counter() - t0), b.request_counts.failed
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("data/fortunes"), help="bench/classification_data.py's --out")
    ap.add_argument("--model", type=Path, help="the fine-tuned unmask model (skipped when not given)")
    ap.add_argument("--twin", type=Path, help="the fine-tuned AR twin (skipped when not given)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--speed-lines", type=int, default=0, help="also time a file of N lines (test lines repeated)")
    ap.add_argument("--server", action="store_true", help="with --speed-lines: also through /v1/batches")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    for p in (args.data / "train.jsonl", args.data / "test.jsonl", args.model, args.twin):
        if p is not None and not p.exists():
            sys.exit(f"error: {p} does not exist (bench/classification_data.py writes the data)")
    if args.server and not (args.speed_lines and args.model):
        sys.exit("error: --server needs --speed-lines N and --model")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    train, test = cd.read_jsonl(args.data / "train.jsonl"), cd.read_jsonl(args.data / "test.jsonl")
    gold = [r["label"] for r in test]
    meta = json.loads((args.data / "labels.json").read_text()) if (args.data / "labels.json").is_file() else {}
    labels = meta.get("labels") or sorted({r["label"] for r in train})
    res: dict = {"dataset": meta, "threads": args.threads, "max_num_seqs": args.max_num_seqs,
                 "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start",
                 "command": " ".join(["python", *sys.argv])}
    res["tfidf"] = tfidf(train, test, labels, args.speed_lines)
    tmp = Path(tempfile.mkdtemp(prefix="bench-cls-"))
    if args.model:
        inp = tmp / "test.jsonl"
        cd.write_jsonl(inp, (cd.batch_line(r, labels) for r in test))
        rate, wall = run_batch(args.model, inp, tmp / "out.jsonl", args.threads, args.max_num_seqs)
        got = predictions(tmp / "out.jsonl")
        res["unmask"] = {**cd.scores(gold, [got.get(r["id"]) for r in test], labels), "model": str(args.model),
                         "items_per_s": rate, "wall_s": wall}
        if args.speed_lines:
            reps = (test * (args.speed_lines // len(test) + 1))[:args.speed_lines]
            big = tmp / "speed.jsonl"
            cd.write_jsonl(big, (cd.batch_line(r, labels, f"{r['id']}-{i}") for i, r in enumerate(reps)))
            server = {}
            if args.server:  # at the same time as the offline run, so that both see the same load on a shared machine
                th = threading.Thread(target=lambda: server.update(r=server_items_per_s(
                    args.model, big, args.threads, args.max_num_seqs, tmp)))
                th.start()
            rate, wall = run_batch(args.model, big, tmp / "speed-out.jsonl", args.threads, args.max_num_seqs)
            if args.server:
                th.join()
            got = predictions(tmp / "speed-out.jsonl")
            res["speed"] = {"lines": args.speed_lines, "repeated_from": len(test), "offline_items_per_s": rate,
                            "offline_wall_s": wall,
                            "offline_accuracy": sum(got.get(f"{r['id']}-{i}") == r["label"]
                                                    for i, r in enumerate(reps)) / len(reps)}
            if args.server:
                rate, failed = server["r"]
                res["speed"].update(server_items_per_s=rate, server_failed=failed,
                                    server_over_offline=rate / res["speed"]["offline_items_per_s"])
    if args.twin:
        from classification_twin import TwinClassifier

        clf = TwinClassifier(args.twin, labels, args.threads)
        prompts = [cd.prompt(r["text"], labels) for r in test]
        t0 = time.perf_counter()
        pred = clf.classify(prompts)
        res["twin"] = {**cd.scores(gold, pred, labels), "model": str(args.twin),
                       "items_per_s": len(prompts) / (time.perf_counter() - t0)}
    print(json.dumps(res, indent=1))
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
