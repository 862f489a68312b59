"""The held-out tasks of the model card (`unmask eval`) for the small A/B benches: one loader, one set of flags."""
from __future__ import annotations

import argparse
from pathlib import Path

from unmask.engine.llm import LLM
from unmask.evaluation import Task, function_tasks, infill_tasks, next_line_tasks
from unmask.train.corpus import read_documents
from unmask.train.sft import read_jsonl


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="src/unmask/assets/unmask-tiny")
    ap.add_argument("--heldout", default="data/corpus/heldout.jsonl")
    ap.add_argument("--sft-heldout", default="data/sft/heldout.jsonl")
    ap.add_argument("--limit", type=int, default=200, help="tasks of each kind")


def load(args: argparse.Namespace) -> tuple[LLM, list[dict], list[list[Task]]]:
    """(the model in float32 on the CPU, the held-out chat / FIM records, [infill, next-line, function tasks])."""
    llm = LLM(args.model, dtype="float32", device="cpu")
    docs = list(read_documents(Path(args.heldout)))
    records = [r for _, r in read_jsonl(args.sft_heldout)[0]]
    tasks = [infill_tasks(records, args.limit), next_line_tasks(docs, args.limit), function_tasks(docs, args.limit)]
    return llm, records, tasks
