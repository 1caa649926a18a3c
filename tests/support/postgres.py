"""A throwaway PostgreSQL server on loopback, for the tests of the shared job store.

Debian's packaged server binaries (``apt-get install postgresql``), run from a temporary
data folder: trust authentication, on 127.0.0.1 and a free port, its socket in that folder,
no fsync. As root, initdb refuses to run, so the server runs as the ``postgres`` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import free_port

INSTALL = "apt-get install -y --no-install-recommends postgresql"
START_TIMEOUT_S = 30.0
FAST_INIT = ("--no-sync", "--encoding", "UTF8")
OPTIONS = ("-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=50")


def _binary(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    if found is None:
        pytest.skip(
            f"PostgreSQL is not installed: run `{INSTALL}` (the README's test command does)"
        )
    return found


def _as_server_user() -> list[str]:
    """The prefix that runs a command as the ``postgres`` user when we are root."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"]


class PostgresServer:
    """One server on a data folder of its own, which a test may stop and start again (an
    outage) or pause with SIGSTOP (a server that hangs: connections stay open, nothing
    answers)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = (self.folder / "server.log").open("ab")
        command = [*_as_server_user(), _binary("postgres"), "-D", str(self.folder / "data")]
        command += ["-p", str(self.port), "-k", str(self.folder), *OPTIONS]
        self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_ready(self.port, self._process, self.folder)

    def stop(self) -> None:
        """Fast shutdown: open sessions are cut, as when a server goes down."""
        if self._process is None:
            return
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Every process of the server stopped (SIGSTOP) inside the block: the postmaster
        first, so it forks no more, then each of its children (each in a session of its
        own, so no process group holds them all)."""
        assert self._process is not None
        postmaster = self._process.pid
        os.kill(postmaster, signal.SIGSTOP)
        processes = [postmaster, *_children(postmaster)]
        for child in processes[1:]:
            os.kill(child, signal.SIGSTOP)
        try:
            yield
        finally:
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process, signal.SIGCONT)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # The command may hold spaces; the fields after its closing parenthesis don't.
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A started server, stopped and removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix="penstock-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
    initdb = [_binary("initdb"), "-D", str(folder / "data"), "-U", "postgres", "-A", "trust"]
    subprocess.run(
        [*_as_server_user(), *initdb, *FAST_INIT],
        check=True,
        capture_output=True,
        timeout=120,
    )
    server = PostgresServer(folder)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def running_postgres() -> Iterator[str]:
    """Start a server; yields the SQLAlchemy URL of its ``postgres`` database."""
    with postgres_server() as server:
        yield server.url


def _wait_ready(port: int, server: subprocess.Popen[bytes], folder: Path) -> None:
    import psycopg

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"postgres exited:\n{(folder / 'server.log').read_text()}")
        try:
            psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres").close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def fresh_database(url: str) -> str:
    """A new empty database on the server of ``url``; returns its URL."""
    import psycopg

    name = f"jobs_{uuid.uuid4().hex[:12]}"
    server = url.rsplit("/", 1)[0]
    with psycopg.connect(
        server.replace("postgresql+psycopg://", "postgresql://") + "/postgres", autocommit=True
    ) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{server}/{name}"
