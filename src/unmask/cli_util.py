"""What every command module of the CLI shares: one-line errors, plain warnings, output-file checks."""
from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import typer


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@contextlib.contextmanager
def plain_warnings():
    """Warnings (skipped records, ...) as `warning: …` lines on stderr, without Python's file:line and source line."""
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_a, **_k: typer.echo(f"warning: {message}", err=True)
        yield


def check_utf8(text: str, what: str) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        fail(f"{what} is not valid UTF-8")


def check_output_file(path: Path | None, flag: str) -> None:
    """Before a long run: a results file that cannot be written would lose its results at the end."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"{flag} {path} cannot be written (a directory, or its folder is missing or read-only)")
