"""Start ``penstock serve`` as a real subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def start_server(
    args: list[str],
    log_dir: Path,
    *,
    env: dict[str, str] | None = None,
    ready_timeout: float = 60.0,
    wait_ready: bool = True,
    python: Path | None = None,
) -> ServerProcess:
    """Run ``penstock serve --port <free> *args`` (with ``python``, else this interpreter);
    wait until ``/live`` answers."""
    port = free_port()
    log_path = log_dir / f"penstock-{port}.log"
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [str(python or sys.executable), "-m", "penstock", "serve", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO_ROOT,
            text=True,
        )
    server = ServerProcess(process, port, log_path)
    if wait_ready:
        wait_until_ready(server, ready_timeout)
    return server


def wait_until_ready(
    server: ServerProcess, ready_timeout: float, since: float | None = None
) -> None:
    """Wait until ``server``'s ``/live`` answers, ``ready_timeout`` seconds at most from
    ``since`` (``time.monotonic()``; now unless given)."""
    deadline = (time.monotonic() if since is None else since) + ready_timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/live", timeout=1.0).status_code == 200:
                return
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not ready in {ready_timeout}s:\n{server.log()}")


@contextlib.contextmanager
def running_server(args: list[str], log_dir: Path, **kwargs: object) -> Iterator[ServerProcess]:
    server = start_server(args, log_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.stop(signal.SIGKILL)


@contextlib.contextmanager
def running_servers(
    starts: list[tuple[list[str], Path]],
    *,
    env: dict[str, str] | None = None,
    ready_timeout: float = 60.0,
) -> Iterator[list[ServerProcess]]:
    """``running_server`` for each ``(args, log_dir)`` of ``starts``, all started before any
    is waited for: their start-ups (mostly imports) overlap on the machine's cores."""
    servers: list[ServerProcess] = []
    try:
        for args, log_dir in starts:
            servers.append(start_server(args, log_dir, env=env, wait_ready=False))
        started = time.monotonic()
        for server in servers:
            wait_until_ready(server, ready_timeout, started)
        yield servers
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.stop(signal.SIGKILL)


def transformers_args(
    model_dir: Path, *gateway_args: str, engine_args: tuple[str, ...] = ()
) -> list[str]:
    """``penstock serve`` arguments of the transformers engine on a local checkpoint, one CPU
    thread."""
    args = ["--engine", "transformers", "--model", str(model_dir), *gateway_args]
    return [*args, "--", "--cpu-threads", "1", *engine_args]


@contextlib.contextmanager
def transformers_server(
    model_dir: Path, log_dir: Path, *gateway_args: str, engine_args: tuple[str, ...] = ()
) -> Iterator[ServerProcess]:
    """``penstock serve --engine transformers`` on a local checkpoint: one CPU thread, no hub."""
    args = transformers_args(model_dir, *gateway_args, engine_args=engine_args)
    with running_server(args, log_dir, env={"HF_HUB_OFFLINE": "1"}, ready_timeout=120) as process:
        yield process
