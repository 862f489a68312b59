"""The `--ray` halves of `unmask serve` and `unmask batch` (the flags live in server/cli.py and batch/cli.py)."""
from __future__ import annotations

import signal
import threading

import typer

from unmask.cluster import ClusterError, require_ray


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def serve_on_ray(args, host: str, port: int, root_path: str, address: str | None, replicas: int,
                 autoscale: str | None, num_cpus: float, num_gpus: float) -> None:
    """Deploy the Serve application, then wait for Ctrl-C or SIGTERM and take it down (and a cluster we started)."""
    from unmask.cluster import launch

    if root_path:
        _fail("--root-path is not supported with --ray (Ray Serve's proxy serves the application at /)")
    if port == 0:
        _fail("--ray needs a fixed --port (Ray Serve's proxy does not report a port chosen at random)")
    try:
        require_ray()
        scale = launch.Scale(replicas=replicas, autoscale=launch.parse_autoscale(autoscale) if autoscale else None,
                             num_cpus=num_cpus, num_gpus=num_gpus)
        started = launch.connect(address)
    except ClusterError as e:
        _fail(str(e))
    import ray

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        launch.deploy(args, scale, host, port)
        count = f"{scale.autoscale[0]}-{scale.autoscale[1]} (autoscaled)" if scale.autoscale else str(scale.replicas)
        typer.echo(f"unmask: serving {args.served_model_name} on http://{host}:{port} with {count} engine "
                   f"replica(s) on Ray {'at ' + address if address else '(a local cluster)'}; Ctrl-C stops",
                   err=True)
        stop.wait()
    except ClusterError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    finally:
        try:
            launch.undeploy(stop_serve=started)
        finally:
            if started:
                ray.shutdown()
