"""Which replica served an answer (``x-penstock-replica``), and a fleet that heals: a
replica started after a weight update takes the fleet's weights before it serves.

A local two-node Ray cluster (two logical CPUs per node) runs a two-replica fleet of the
sample engine, then a one-replica fleet. Weights change by a tensor push; a replica is
then killed with SIGKILL and Ray's replacement must come back on the pushed weights
without the trainer pushing again: from its peer's weights in the object store (two
replicas) or from the push the ingress kept (one replica). The module takes about
90-150 s on two cores (cluster ~7 s, each fleet ~15-30 s to deploy, each replacement
~10-20 s, teardown ~15 s each).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip(
    "ray", reason="Ray Serve is not installed: pip install 'penstock[ray]' to run tests/ray"
)
from ray.cluster_utils import Cluster  # noqa: E402

from penstock.ray.replica_header import REPLICA_HEADER  # noqa: E402
from tests.support.ray_cluster import two_node_cluster  # noqa: E402
from tests.support.server import ServerProcess, start_server  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = "sample-model"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with two_node_cluster(cpus_per_node=2) as started:
        yield started


def serve_fleet(
    cluster: Cluster, log_dir: Path, replicas: int, app_name: str
) -> Iterator[httpx.Client]:
    args = [
        "--ray",
        "--ray-address",
        cluster.address,
        "--ray-app-name",
        app_name,
        "--ray-replicas",
        str(replicas),
        "--ray-replica-cpus",
        "1",
        "--engine",
        "sample",
    ]
    process: ServerProcess = start_server(args, log_dir, ready_timeout=120)
    try:
        with httpx.Client(base_url=process.base_url, timeout=60) as client:
            yield client
    finally:
        if process.stop(signal.SIGTERM, timeout=60) != 0:
            print(process.log())


@pytest.fixture(scope="class")
def pair(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    yield from serve_fleet(cluster, tmp_path_factory.mktemp("pair"), 2, "penstock-pair")


@pytest.fixture(scope="class")
def single(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    yield from serve_fleet(cluster, tmp_path_factory.mktemp("single"), 1, "penstock-single")


def live_replicas(
    client: httpx.Client, count: int, checksum: str | None = None
) -> dict[str, dict[str, Any]]:
    """``/health``'s replicas once ``count`` of them answer with their state (and all
    report ``checksum``: the view is refreshed every second)."""
    deadline = time.monotonic() + 60
    while True:
        replicas = client.get("/health").json()["fleet"]["replicas"]
        live = {name: r for name, r in replicas.items() if "state" in r}
        checksums = {r.get("checksum") for r in live.values()}
        agreed = checksums == {checksum} if checksum else all(checksums)
        if len(live) == count and agreed:
            return live
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


def chat(
    client: httpx.Client, headers: dict[str, str] | None = None, **extra: Any
) -> httpx.Response:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **extra}
    reply = client.post("/v1/chat/completions", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    return reply


class TestTwoReplicas:
    def test_every_answer_names_the_replica_that_served_it(self, pair: httpx.Client) -> None:
        names = set(live_replicas(pair, 2))
        seen = {chat(pair).headers[REPLICA_HEADER] for _ in range(20)}
        # No session key, a short prompt: no affinity, so both serve.
        assert seen == names

        completion = pair.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
        )
        generated = pair.post(
            "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}
        )
        for reply in (completion, generated):
            assert reply.status_code == 200, reply.text
            assert reply.headers[REPLICA_HEADER] in names
        for path, body in (
            ("/v1/chat/completions", {"messages": HELLO}),
            ("/v1/completions", {"prompt": "x"}),
        ):
            streamed = {"model": MODEL, "max_tokens": 3, "stream": True, **body}
            with pair.stream("POST", path, json=streamed) as response:
                assert response.status_code == 200
                assert response.headers[REPLICA_HEADER] in names
                lines = [line for line in response.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"

    def test_a_session_keeps_its_replica_in_the_header(self, pair: httpx.Client) -> None:
        names = set(live_replicas(pair, 2))
        alice = {
            chat(pair, headers={"X-Session-Id": "alice"}).headers[REPLICA_HEADER] for _ in range(6)
        }
        assert len(alice) == 1 and alice <= names
        users = {chat(pair, user=f"user-{i}").headers[REPLICA_HEADER] for i in range(16)}
        assert users == names

    def test_answers_without_a_replica_carry_no_header(self, pair: httpx.Client) -> None:
        assert REPLICA_HEADER not in pair.get("/health").headers
        refused = pair.post("/v1/chat/completions", json={"model": MODEL})
        assert refused.status_code == 400
        assert REPLICA_HEADER not in refused.headers
