"""The `--ray` halves of `unmask serve` and `unmask batch` (the flags live in server/cli.py and batch/cli.py)."""
from __future__ import annotations

import asyncio
import os
import signal

import typer

from unmask.cluster import ClusterError, require_ray


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def serve_on_ray(args, host: str, port: int, root_path: str, address: str | None, replicas: int,
                 autoscale: str | None, num_cpus: float, num_gpus: float) -> None:
    """Deploy the engine replicas, serve HTTP in front of them (front.py) until Ctrl-C or SIGTERM, then take them
    down (and a cluster we started)."""
    import click

    from unmask.cluster import launch

    context = click.get_current_context(silent=True)   # `unmask serve --log-level`, already checked there
    log_level = str((context.params.get("log_level") if context else None) or "info").lower()

    try:
        launch.use_serve_loops()   # the gateway's router, before Ray Serve is imported
        require_ray()
        scale = launch.Scale(replicas=replicas, autoscale=launch.parse_autoscale(autoscale) if autoscale else None,
                             num_cpus=num_cpus, num_gpus=num_gpus, niceness=os.getpriority(os.PRIO_PROCESS, 0),
                             autoscaling=launch.parse_autoscaling(os.environ.get("UNMASK_AUTOSCALING_CONFIG") or "{}"))
        if scale.autoscale is not None:
            launch.autoscaling_config(scale, args.max_num_seqs)   # initial_replicas outside MIN,MAX: one line now
        started = launch.connect(address)
    except ClusterError as e:
        _fail(str(e))
    import ray
    import ray.serve

    from unmask.cluster.front import serve_http

    def ready(bound: int) -> None:
        count = f"{scale.autoscale[0]}-{scale.autoscale[1]} (autoscaled)" if scale.autoscale else str(scale.replicas)
        typer.echo(f"unmask: serving {args.served_model_name} on http://{host}:{bound} with "
                   f"{count} engine replica(s) on Ray {'at ' + address if address else '(a local cluster)'}; Ctrl-C "
                   "stops", err=True)

    def interrupt(*_) -> None:   # SIGTERM while the replicas load: stop as Ctrl-C does, through the `finally`
        raise KeyboardInterrupt

    taken_down = []

    async def take_down() -> None:   # on the gateway's loop, which its Serve router needs running (front.py)
        await asyncio.to_thread(launch.undeploy)
        if started:
            await ray.serve.shutdown_async()
        taken_down.append(True)

    signal.signal(signal.SIGTERM, interrupt)
    try:
        gateway = launch.deploy(args, scale)
        serve_http(gateway, host, port, root_path, log_level, args.drain_timeout, ready, on_stopped=take_down)
    except ClusterError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    finally:
        try:
            if not taken_down:   # stopped before serving, or interrupted while taking down
                launch.undeploy(stop_serve=started)
        finally:
            if started:
                ray.shutdown()
