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


@contextlib.contextmanager
def running_postgres() -> Iterator[str]:
    """Start a server; yields the SQLAlchemy URL of its ``postgres`` database."""
    initdb, postgres = _binary("initdb"), _binary("postgres")
    folder = Path(tempfile.mkdtemp(prefix="penstock-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
    data = folder / "data"
    subprocess.run(
        [*_as_server_user(), initdb, "-D", str(data), "-U", "postgres", "-A", "trust", *FAST_INIT],
        check=True,
        capture_output=True,
        timeout=120,
    )
    port = free_port()
    log = (folder / "server.log").open("wb")
    server = subprocess.Popen(
        [
            *_as_server_user(),
            postgres,
            "-D",
            str(data),
            "-p",
            str(port),
            "-k",
            str(folder),
            *OPTIONS,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    try:
        _wait_ready(port, server, folder)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


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
