"""Serve autoscaling of ``penstock serve --ray`` by the streams the replicas report.

Streams travel the data plane, not Serve's handle calls, so Serve's own count sees none;
the replicas report theirs (:mod:`penstock.ray.replica_load`). A fleet of one replica of
the sample engine (at most two, one stream per replica as the target) gets four long
streams and must grow to two replicas, a second after it is over its target
(``--ray-upscale-delay-s 1``). The module takes about 20-60 s on two cores (deployment
~10 s, the new replica ~10 s, teardown ~5 s; the
package's cluster, ``tests/ray/conftest.py``, ~7 s more for the first module that asks).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

ray = pytest.importorskip(
    "ray", reason="Ray Serve is not installed: pip install 'penstock[ray]' to run tests/ray"
)
from ray.cluster_utils import Cluster  # noqa: E402

from tests.support.ray_cluster import fleet_replicas, fleet_server  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = "sample-model"
STREAMS = 4


@pytest.fixture(scope="module")
def server(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--ray-min-replicas", "1", "--ray-max-replicas", "2"]
    args += ["--ray-target-ongoing-requests", "1", "--ray-upscale-delay-s", "1"]
    args += ["--engine", "sample", "--", "--delay", "0.1"]
    log_dir = tmp_path_factory.mktemp("ray-scaling")
    with fleet_server(cluster, log_dir, args, replicas=1) as process:
        yield process


def live(server: ServerProcess) -> dict[str, dict[str, object]]:
    return {name: replica for name, replica in fleet_replicas(server).items() if "state" in replica}


def stream_until(server: ServerProcess, stop: threading.Event, statuses: list[int]) -> None:
    """A stream of about three minutes (the sample engine's context holds 2048 tokens),
    left once ``stop`` is set."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1800, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
    ) as response:
        statuses.append(response.status_code)
        for _ in response.iter_lines():
            if stop.is_set():
                return


def test_streams_on_the_data_plane_scale_the_fleet_out(server: ServerProcess) -> None:
    assert len(live(server)) == 1
    stop = threading.Event()
    statuses: list[int] = []
    threads = [
        threading.Thread(target=stream_until, args=(server, stop, statuses)) for _ in range(STREAMS)
    ]
    for thread in threads:
        thread.start()
    try:
        # Serve's own count of this fleet's requests stays at the admin calls: without
        # the streams the replicas report it would keep one replica.
        deadline = time.monotonic() + 150
        while len(replicas := live(server)) < 2:
            assert time.monotonic() < deadline, replicas
            assert all(thread.is_alive() for thread in threads), statuses
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
