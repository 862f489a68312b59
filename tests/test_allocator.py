"""The training commands re-execute themselves under jemalloc (unmask/allocator.py) where it is installed."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from unmask.allocator import KEEP_PAGES, find_jemalloc, reexec_env

LIB = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def test_reexec_env_preloads_jemalloc_once_and_keeps_its_pages():
    env = reexec_env({"PATH": "/bin"}, LIB)
    assert env["LD_PRELOAD"] == LIB and env["MALLOC_CONF"] == KEEP_PAGES and env["PATH"] == "/bin"
    assert reexec_env(env, LIB) is None                       # the re-executed process runs as it is
    kept = reexec_env({"LD_PRELOAD": "/opt/libfoo.so", "MALLOC_CONF": "narenas:2"}, LIB)
    assert kept["LD_PRELOAD"] == f"{LIB} /opt/libfoo.so" and kept["MALLOC_CONF"] == "narenas:2"


def test_serving_commands_take_jemallocs_own_decay_and_ray_runs_are_left_alone(monkeypatch):
    """serve / batch re-execute with jemalloc's default MALLOC_CONF (freed pages go back after its decay), training
    keeps its pages; with --ray (Ray starts the processes) and for other commands nothing happens."""
    from unmask import allocator

    assert "MALLOC_CONF" not in reexec_env({"PATH": "/bin"}, LIB, None)
    calls = []
    monkeypatch.setattr(allocator, "find_jemalloc", lambda: LIB)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator.os, "execve", lambda exe, args, env: calls.append(env))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    monkeypatch.delenv("UNMASK_ALLOCATOR_REEXEC", raising=False)
    monkeypatch.delenv("UNMASK_ALLOCATOR", raising=False)
    for argv in (["unmask", "serve", "--port", "0"], ["unmask", "batch", "in.jsonl"], ["unmask", "ngram-drafts"],
                 ["unmask", "distill"],
                 ["unmask", "serve", "--ray"], ["unmask", "batch", "--ray", "x"], ["unmask", "generate", "hi"]):
        allocator.maybe_reexec(argv)
    assert [c["LD_PRELOAD"] for c in calls] == [LIB] * 4
    assert ["MALLOC_CONF" in c for c in calls] == [False, False, False, True]


@pytest.mark.parametrize("environ, lib", [
    ({}, None),                                                 # not installed
    ({"UNMASK_ALLOCATOR": "glibc"}, LIB),                       # the user's choice
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, LIB),         # another allocator preloaded already
])
def test_reexec_env_leaves_the_process_alone(environ, lib):
    assert reexec_env(environ, lib) is None


def test_an_unknown_allocator_is_a_one_line_error_before_training(tmp_path):
    """A typo in UNMASK_ALLOCATOR stops the command at once (it used to run on glibc without a word)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    r = subprocess.run([sys.executable, "-m", "unmask.cli", "train", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, env={**environ, "UNMASK_ALLOCATOR": "jemaloc"}, timeout=120)
    assert r.returncode == 2 and not (tmp_path / "run").exists()
    assert r.stderr.strip() == "Error: UNMASK_ALLOCATOR must be one of jemalloc, glibc, got 'jemaloc'"
    assert reexec_env({"UNMASK_ALLOCATOR": " GLIBC "}, LIB) is None   # case and spaces are forgiven


def _train(tmp_path: Path, name: str, **env) -> str:
    from test_train import TEXT, TINY_FLAGS, write_char_tokenizer, write_corpus

    tok, corpus = tmp_path / "tok", tmp_path / "corpus"
    if not tok.exists():
        tok.mkdir(), corpus.mkdir()
        write_char_tokenizer(tok), write_corpus(corpus, TEXT * 3)
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    cmd = [sys.executable, "-m", "unmask.cli", "train", "--data", str(corpus), "--tokenizer", str(tok),
           "--out", str(tmp_path / name), *map(str, TINY_FLAGS)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**environ, **env}, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(find_jemalloc() is None or not sys.platform.startswith("linux"),
                    reason="libjemalloc2 is not installed (make setup installs it as root)")
def test_unmask_train_runs_under_jemalloc_with_the_same_losses(tmp_path):
    je = _train(tmp_path, "je")
    glibc = _train(tmp_path, "glibc", UNMASK_ALLOCATOR="glibc")
    header = [line for line in je.splitlines() if "process(es) on cpu" in line]
    assert header and header[0].endswith("float32, jemalloc"), je
    assert "jemalloc" not in glibc and "process(es) on cpu, float32" in glibc
    losses = [re.findall(r"step \d+/\d+ loss (\S+)", out) for out in (je, glibc)]
    assert losses[0] and losses[0] == losses[1]

