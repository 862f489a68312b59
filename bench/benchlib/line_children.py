"""What bench/compiled_startup.py and bench/compiled_first_forward.py share: held-out next lines decoded one at a
time in child processes of their own (a child per variant, since the variant is process state: the inductor
cache, a module limit), the parent reading each child's result from its last line of stdout."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchlib.common import ROOT


def add_args(ap: argparse.ArgumentParser, tasks: int = 40) -> None:
    ap.add_argument("--model", type=Path, default=ROOT / "src/unmask/assets/unmask-tiny")
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/corpus")
    ap.add_argument("--tasks", type=int, default=tasks)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)


def run_child(script: str, args: argparse.Namespace, extra: list[str], name: str, env: dict | None = None):
    """`script` again with the shared arguments and `extra`; its last stdout line as JSON (a failure: one line)."""
    cmd = [sys.executable, script, *extra, "--model", str(args.model), "--corpus", str(args.corpus),
           "--tasks", str(args.tasks), "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"{name}: {(out.stderr.strip().splitlines() or ['exited ' + str(out.returncode)])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def line_requests(llm, args: argparse.Namespace, max_tokens: int) -> tuple[list[list[int]], list]:
    """The first `args.tasks` held-out next lines as (prompt ids, params), the model's default policy."""
    from unmask.engine.params import GenerationParams
    from unmask.evaluation import next_line_tasks
    from unmask.train.corpus import read_documents

    tasks = next_line_tasks(list(read_documents(args.corpus / "heldout.jsonl")), args.tasks)
    prompts = [llm.encode(t.prompt) for t in tasks]
    params = [GenerationParams(max_tokens=max_tokens, stop=list(t.stop), min_tokens=min(t.min_tokens, max_tokens))
              for t in tasks]
    return prompts, params
