"""The Ray cluster ``penstock serve --ray`` starts for itself when given no ``--ray-address``.

Its processes (GCS, raylet, the replicas' workers) run in a process group of their own, a
``ray start --head --block`` session: a signal to the server's process group (what a
supervisor or ``docker stop`` sends) reaches the server only, which then drains, stops
the Serve application while Ray still answers, and ends the cluster itself
(:meth:`LocalCluster.stop`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from penstock.errors import RaySetupError

# How long the cluster may take to come up, and to go once told.
_START_S = 90.0
_STOP_S = 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalCluster:
    """A single-node Ray cluster in its own process group, owned by this server."""

    def __init__(self) -> None:
        """Give this process the cluster's own Ray token; Ray reads it when first imported,
        so construct this before that (Ray's default token, a file in the home
        directory, may be another cluster's)."""
        self._process: subprocess.Popen[bytes] | None = None
        self.address = ""
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)

    def start(self) -> str:
        """Start the head node and wait until it accepts drivers; its ``host:port``."""
        port = _free_port()
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head"]
        argv += [f"--port={port}", "--include-dashboard=false", "--disable-usage-stats"]
        argv += ["--block"]
        self._process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RaySetupError(f"ray start exited with {self._process.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return self.address
            time.sleep(0.2)
        self.stop()
        raise RaySetupError(f"the local Ray cluster did not start within {_START_S:g}s")

    def stop(self) -> None:
        """End every process of the cluster: its group is told to stop, then killed."""
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=_STOP_S)
        # Whatever of the group outlived the head (a worker stuck in its engine).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
