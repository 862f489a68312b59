"""`unmask batch IN.jsonl OUT.jsonl`: see offline.py."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from unmask.defaults import DEVICE_HELP, DTYPE_HELP


def batch(
    input_path: Path = typer.Argument(..., metavar="IN.jsonl",
                                      help="Requests: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"} per line."),
    output_path: Path = typer.Argument(..., metavar="OUT.jsonl",
                                       help="Results in input order; a partial one is resumed."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Model directory (default: the built-in "
                                                                      "unmask-tiny)."),
    max_num_seqs: int = typer.Option(64, min=1, help="Requests decoded together."),
    max_line_bytes: int = typer.Option(4 * 2**20, min=1, help="Longest request line accepted (as the server's "
                                                              "--max-body-bytes)."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    progress: bool = typer.Option(True, help="Show a progress bar."),
):
    """Run a file of Batch API requests offline, keeping the engine full."""
    from unmask.batch.offline import run
    from unmask.errors import UnmaskError

    try:
        summary = run(input_path, output_path, model, max_num_seqs, dtype, device, max_line_bytes, progress)
    except UnmaskError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{summary.succeeded} succeeded, {summary.failed} failed, {summary.skipped} already in "
               f"{output_path}, of {summary.total}; {summary.requests_per_s:.2f} requests/s", err=True)
