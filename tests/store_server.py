"""An in-process `unmask serve` app (uvicorn in a thread, the built-in model) with a data directory, for the
Files and Batch API tests."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest


@dataclass
class LiveApp:
    url: str
    app: object
    server: object
    thread: threading.Thread

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def wait_model(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.app.state.serving is None and time.monotonic() < deadline:
            if self.app.state.load_error:
                pytest.fail(self.app.state.load_error)
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def start_app(data_dir: Path | None, **server_args) -> LiveApp:
    import uvicorn

    from unmask.defaults import default_model_path
    from unmask.server.app import ServerArgs, create_app

    args = ServerArgs(model=default_model_path(), served_model_name="unmask-tiny", data_dir=data_dir, **server_args)
    app = create_app(args)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-store-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_health(url, ready=lambda status: True, alive=thread.is_alive, timeout=60)   # files need no model
    return LiveApp(url, app, server, thread)


def wait_health(url: str, ready, alive, timeout: float = 120) -> None:
    """Poll GET /health until `ready(status)` (the socket answering at all counts for some callers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert alive(), "the server stopped"
        try:
            if ready(httpx.get(f"{url}/health", timeout=2).status_code):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    pytest.fail(f"server at {url} not ready after {timeout} s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
