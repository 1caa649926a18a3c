"""Which replica served an answer (``x-penstock-replica``), and a fleet that heals: a
replica started after a weight update takes the fleet's weights before it serves.

The package's two-node Ray cluster (``tests/ray/conftest.py``) runs a two-replica fleet
of the sample engine, then a one-replica fleet. Weights change by a tensor push; a replica is
then killed with SIGKILL and Ray's replacement must come back on the pushed weights
without the trainer pushing again: from its peer's weights in the object store (two
replicas) or from the push the ingress kept (one replica); a two-replica fleet of the
transformers engine on the tiny checkpoint heals from its peer too. The module takes
about 90-300 s on two cores (each sample fleet ~5-65 s to deploy and the transformers
one longer, each replacement ~10-20 s, teardown ~5-15 s each).
"""

from __future__ import annotations

import os
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

from penstock.engines.samples.engine import write_sample_weights  # noqa: E402
from penstock.ray.replica_header import REPLICA_HEADER  # noqa: E402
from tests.support.ray_cluster import fleet_server  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = "sample-model"
HELLO = [{"role": "user", "content": "hi"}]


def serve_fleet(
    cluster: Cluster,
    log_dir: Path,
    replicas: int,
    app_name: str,
    engine: tuple[str, ...] | list[str] = ("--engine", "sample"),
) -> Iterator[httpx.Client]:
    args = ["--ray-app-name", app_name, *engine]
    with (
        fleet_server(cluster, log_dir, args, replicas=replicas, ready_timeout=300) as process,
        httpx.Client(base_url=process.base_url, timeout=60) as client,
    ):
        yield client


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


def push_tensors(client: httpx.Client, shift: int, version: str) -> str:
    """The fleet's checksum after one tensor push of the sample model's weights."""
    pushed = client.post(
        "/update_weights_from_tensor",
        json={"named_tensors": {"token_shift": [shift]}, "weight_version": version},
    )
    assert pushed.status_code == 200, pushed.text
    checksum: str = pushed.json()["checksum"]
    return checksum


def fleet_checksum(client: httpx.Client) -> str:
    """The whole-model checksum the fleet's last weight update committed."""
    committed: str = client.get("/health").json()["fleet"]["fleet_weights"]["checksum"]
    return committed


def sigkill(replica: str) -> None:
    """SIGKILL the process of ``replica`` (a Serve actor on this machine's cluster)."""
    actor = ray.get_actor(replica, namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)


def healed(client: httpx.Client, before: set[str], model: str = MODEL) -> tuple[str, set[Any]]:
    """Requests while the fleet heals, until one is served by a replica not in ``before``
    (the header names it): that replica, and every weight version the answers carried.
    A replica out of rotation serves nothing meanwhile."""
    versions: set[Any] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        reply = client.post(
            "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}
        )
        served_by = None
        if reply.status_code == 200:
            versions.add(reply.json()["weight_version"])
            served_by = reply.headers[REPLICA_HEADER]
        else:
            assert reply.json()["error"]["code"] == "replica_lost", reply.text
        replicas = client.get("/health").json()["fleet"]["replicas"]
        fresh = {name: r for name, r in replicas.items() if name not in before and "state" in r}
        for replica in fresh.values():
            if not replica["in_rotation"]:
                assert replica["served"] == 0, replica
        if served_by in fresh:
            return served_by, versions
        time.sleep(0.1)
    raise AssertionError(f"no replacement served within 120 s: {replicas}")


def assert_on_fleet_weights(
    client: httpx.Client, replica: str, checksum: str, version: str, source: str
) -> None:
    """``replica`` serves the fleet's weights, taken from ``source``."""
    entry = client.get("/health").json()["fleet"]["replicas"][replica]
    assert entry["in_rotation"] and entry["weight_version"] == version, entry
    assert entry["caught_up_from"] == source, entry
    checked = client.post("/engine/control/weights_checksum", json={}).json()
    assert checked["replicas"][replica]["checksum"] == checksum, checked


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

    def test_a_killed_replica_comes_back_on_the_pushed_weights_from_its_peer(
        self, pair: httpx.Client
    ) -> None:
        checksum = push_tensors(pair, 6, "pushed-pair")
        before = live_replicas(pair, 2, checksum)
        victim, survivor = sorted(before)
        sigkill(victim)

        replacement, versions = healed(pair, set(before))
        # Nothing was served from the checkpoint's weights, and the trainer never pushed again.
        assert versions == {"pushed-pair"}
        source = f"the weights of replica {survivor}"
        assert_on_fleet_weights(pair, replacement, checksum, "pushed-pair", source)


class TestOneReplica:
    def test_a_killed_only_replica_comes_back_on_the_push_the_ingress_kept(
        self, single: httpx.Client
    ) -> None:
        checksum = push_tensors(single, 9, "pushed-single")
        before = live_replicas(single, 1, checksum)
        sigkill(next(iter(before)))

        replacement, versions = healed(single, set(before))
        assert versions == {"pushed-single"}
        # No peer to copy from: the push the ingress kept, replayed.
        source = "update_weights_from_tensor"
        assert_on_fleet_weights(single, replacement, checksum, "pushed-single", source)

    def test_a_replacement_that_cannot_be_healed_stays_out_and_says_why(
        self, single: httpx.Client, tmp_path: Path
    ) -> None:
        """The fleet's last update was from a file since deleted, and no peer is left: the
        replacement stays out of rotation, ``/health`` says why, and the trainer's next
        update brings it in."""
        weights = write_sample_weights(tmp_path / "deleted.safetensors", 4)
        updated = single.post(
            "/engine/update_weights_from_disk",
            json={"model_path": str(weights), "weight_version": "from-disk"},
        )
        assert updated.status_code == 200, updated.text
        before = live_replicas(single, 1, updated.json()["checksum"])
        weights.unlink()
        sigkill(next(iter(before)))

        deadline = time.monotonic() + 120
        while True:
            replicas = single.get("/health").json()["fleet"]["replicas"]
            fresh = {n: r for n, r in replicas.items() if n not in before and "state" in r}
            reasons = [r.get("out_of_rotation", "") for r in fresh.values()]
            if any("taking update_weights_from_disk failed" in reason for reason in reasons):
                break
            assert time.monotonic() < deadline, replicas
            assert all(not r["in_rotation"] for r in fresh.values()), replicas
            time.sleep(0.2)
        (replacement,) = fresh
        assert fresh[replacement]["served"] == 0

        checksum = push_tensors(single, 11, "pushed-again")
        reply = chat(single)
        assert reply.headers[REPLICA_HEADER] == replacement
        assert reply.json()["weight_version"] == "pushed-again"
        assert live_replicas(single, 1, checksum)[replacement]["in_rotation"]


@pytest.fixture(scope="class")
def tiny_pair(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[httpx.Client, Path]]:
    from tests.support.tiny_llm import build_tiny_llama

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    engine = ["--engine", "transformers", "--model", str(model), "--", "--cpu-threads", "1"]
    for client in serve_fleet(
        cluster, tmp_path_factory.mktemp("tiny-pair"), 2, "penstock-tiny", engine
    ):
        yield client, model


@pytest.mark.timeout(480)
class TestTransformersReplicas:
    def test_a_killed_replica_comes_back_on_pushed_tensors_from_its_peer(
        self, tiny_pair: tuple[httpx.Client, Path]
    ) -> None:
        """The peer's whole model crosses the object store: the replacement holds the
        pushed tensor and every other one of the peer, by the whole-model checksum."""
        import base64

        import safetensors.numpy

        client, model = tiny_pair
        norm = safetensors.numpy.load_file(model / "model.safetensors")["model.norm.weight"]
        payload = safetensors.numpy.save({"model.norm.weight": norm * 0.5})
        pushed = client.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [base64.b64encode(payload).decode()],
                "weight_version": "tiny-pushed",
            },
        )
        assert pushed.status_code == 200, pushed.text
        checksum = fleet_checksum(client)
        before = live_replicas(client, 2, checksum)
        victim, survivor = sorted(before)
        sigkill(victim)

        served_model = client.get("/v1/models").json()["data"][0]["id"]
        replacement, versions = healed(client, set(before), served_model)
        assert versions == {"tiny-pushed"}
        source = f"the weights of replica {survivor}"
        assert_on_fleet_weights(client, replacement, checksum, "tiny-pushed", source)
