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
    on_ray: bool = typer.Option(False, "--ray", help="Run on a pool of engines on a Ray cluster with Ray Data "
                                                     "(IN may then be Parquet too; docs/scale-out.md)."),
    address: Optional[str] = typer.Option(None, help="With --ray: the cluster to join (default: start a local one)."),
    workers: int = typer.Option(1, min=1, help="With --ray: engines in the pool (actors)."),
    num_cpus: float = typer.Option(1.0, min=0, help="With --ray: CPUs per engine."),
    num_gpus: float = typer.Option(0.0, min=0, help="With --ray: GPUs per engine."),
):
    """Run a file of Batch API requests offline, keeping the engine full."""
    from unmask.batch.offline import run
    from unmask.errors import UnmaskError

    try:
        if on_ray:
            from unmask.cluster import require_ray

            require_ray()
            from unmask.cluster.batch import run as run_on_ray

            summary = run_on_ray(input_path, output_path, model, max_num_seqs, dtype, device, max_line_bytes,
                                 progress, address, workers, num_cpus, num_gpus)
        else:
            summary = run(input_path, output_path, model, max_num_seqs, dtype, device, max_line_bytes, progress)
    except UnmaskError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{summary.succeeded} succeeded, {summary.failed} failed, {summary.skipped} already in "
               f"{output_path}, of {summary.total}; {summary.requests_per_s:.2f} requests/s"
               + (f" on {summary.nodes} node(s)" if on_ray else ""), err=True)
