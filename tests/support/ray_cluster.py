"""A local two-node Ray cluster for the tests in ``tests/ray``, with this process joined to it,
and ``penstock serve --ray`` fleets on it.

Replicas import the test engines from this checkout, so ``PYTHONPATH`` names it before the
cluster's processes start. Import this module after ``pytest.importorskip("ray")``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from tests.support.server import REPO_ROOT, ServerProcess, start_server


@contextlib.contextmanager
def two_node_cluster(cpus_per_node: int) -> Iterator[Cluster]:
    os.environ["PYTHONPATH"] = str(REPO_ROOT)
    started = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False},
    )
    started.add_node(num_cpus=cpus_per_node)
    started.wait_for_nodes()
    ray.init(address=started.address, log_to_driver=False)
    try:
        yield started
    finally:
        serve.shutdown()
        ray.shutdown()
        started.shutdown()


@contextlib.contextmanager
def fleet_server(
    cluster: Cluster,
    log_dir: Path,
    args: list[str],
    *,
    replicas: int = 2,
    ready_timeout: float = 120,
) -> Iterator[ServerProcess]:
    """``penstock serve --ray`` on ``cluster``: ``replicas`` replicas of one CPU each and
    ``args`` (the engine and the rest); stopped by SIGTERM, its log printed if that fails."""
    fleet_args = ["--ray", "--ray-address", cluster.address, "--ray-replicas", str(replicas)]
    fleet_args += ["--ray-replica-cpus", "1"]
    process = start_server(
        [*fleet_args, *args],
        log_dir,
        env={"HF_HUB_OFFLINE": "1"},
        ready_timeout=ready_timeout,
    )
    try:
        yield process
    finally:
        if process.stop(signal.SIGTERM, timeout=60) != 0:
            print(process.log())


def fleet_replicas(server: ServerProcess) -> dict[str, dict[str, Any]]:
    """``/health``'s view of the fleet's replicas."""
    health = httpx.get(f"{server.base_url}/health", timeout=10).json()
    replicas: dict[str, dict[str, Any]] = health["fleet"]["replicas"]
    return replicas
