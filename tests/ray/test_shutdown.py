"""``penstock serve --ray`` on a Ray cluster of its own, stopped as a supervisor stops it: a
SIGTERM to its whole process group. It drains, stops Serve and its cluster, and exits 0
within the grace period plus 10 s, leaving none of the cluster's processes behind.

The module starts one server (its cluster, one replica: ~20 s on two cores).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip(
    "ray", reason="Ray Serve is not installed: pip install 'penstock[ray]' to run tests/ray"
)
from openai import OpenAI

from tests.support.server import REPO_ROOT, free_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

GRACE_S = 5


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
    below = {root}
    grown = True
    while grown:
        grown = False
        for pid, parent in parents.items():
            if parent in below and pid not in below:
                below.add(pid)
                grown = True
    return below - {root}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_process_group_sigterm_stops_server_and_cluster_within_the_grace(
    tmp_path: Path,
) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    argv = [sys.executable, "-m", "penstock", "serve", "--port", str(port), "--ray"]
    argv += ["--ray-replicas", "1", "--ray-replica-cpus", "0.5"]
    argv += ["--graceful-shutdown-s", str(GRACE_S), "--engine", "sample"]
    with log_path.open("w") as log:
        # A session of its own: the group signal below must not reach this test.
        server = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            assert server.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="sample-model", prompt="x", max_tokens=3)
        assert reply.choices[0].finish_reason == "length"
        cluster = descendants(server.pid)
        assert any(b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in cluster)

        signalled = time.monotonic()
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(timeout=GRACE_S + 10) == 0, log_path.read_text()
        assert time.monotonic() - signalled < GRACE_S + 10
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in cluster) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in cluster if alive(pid)], log_path.read_text()
        assert "did not stop" not in log_path.read_text()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_a_sigterm_while_the_fleet_deploys_stops_the_server_and_its_cluster(
    tmp_path: Path,
) -> None:
    log_path = tmp_path / "server.log"
    argv = [sys.executable, "-m", "penstock", "serve", "--port", str(free_port()), "--ray"]
    argv += ["--ray-replicas", "1", "--ray-replica-cpus", "0.5", "--engine", "sample"]
    with log_path.open("w") as log:
        server = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    try:
        # The cluster is up (its raylet runs) and the replica not yet deployed.
        deadline = time.monotonic() + 120
        cluster: set[int] = set()
        while time.monotonic() < deadline:
            assert server.poll() is None, log_path.read_text()
            cluster = descendants(server.pid)
            if any(b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in cluster):
                break
            time.sleep(0.05)
        assert "engine fleet ready" not in log_path.read_text()

        signalled = time.monotonic()
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(timeout=GRACE_S + 10) == 0, log_path.read_text()
        assert time.monotonic() - signalled < GRACE_S + 10
        deadline = time.monotonic() + 5
        cluster = descendants(server.pid) | cluster
        while any(alive(pid) for pid in cluster) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in cluster if alive(pid)], log_path.read_text()
        assert "told to stop while the engine was starting" in log_path.read_text()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
