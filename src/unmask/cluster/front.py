"""The HTTP front of `unmask serve --ray`: the gateway (ingress.py) under uvicorn in the command's own process, as
`unmask serve` serves its app, calling the engine replicas through one streamed deployment handle.

Why not Ray Serve's HTTP proxy: behind it, a request crossed two processes and two streamed Ray calls before the
engine (proxy -> ingress replica -> engine replica), and each streamed piece crossed both; here it is one
(docs/scale-out.md has the figures). Serve config files and KubeRay still use the proxy (launch.application).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

ABORT_GRACE_S = 5.0   # after the drain timeout, time for the replicas' 503s to come back before uvicorn cancels


def serve_http(gateway, host: str, port: int, root_path: str, log_level: str, drain_timeout: float,
               on_ready: Callable[[int], None], on_stopped: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers), then let open requests finish for up to the drain
    timeout. `on_ready` gets the bound port (a random one for --port 0) once the socket listens; `on_stopped` is
    awaited after the server has stopped, on its event loop: the gateway's Serve router lives on that loop, and
    taking the replicas (and Serve) down after the loop had ended logged an ERROR from the router's update
    client and, where Serve itself stopped, a traceback at every Ctrl-C."""
    import uvicorn

    from unmask.cluster.ingress import build_app

    class Front(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                on_ready(self.servers[0].sockets[0].getsockname()[1])

        async def serve(self, sockets=None) -> None:
            await super().serve(sockets)
            if on_stopped is not None:
                await on_stopped()

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has stopped; the command has its replicas to take down first,
            # and then exits 0 as `unmask serve` does
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(build_app(gateway), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout + ABORT_GRACE_S, root_path=root_path.rstrip("/"))
    Front(config).run()
