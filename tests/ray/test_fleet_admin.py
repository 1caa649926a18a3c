"""Fleet-wide RL admin under ``penstock serve --ray``: one admin call pauses, updates,
verifies and resumes every replica, or rolls every replica back.

The package's two-node Ray cluster (``tests/ray/conftest.py``) runs two servers: two
replicas of the sample engine (``FleetUpdateFailingEngine``: it refuses updates on the
replica a file names), and two replicas of the transformers engine on the tiny
checkpoint. Updates go by disk, tensors, a trainer's gloo broadcast and NIXL pulls from
this process. The module takes about 45-120 s on two cores (the sample deployment
~7-30 s, its tests ~9 s, a killed replica replaced and caught up ~10-20 s, the
transformers deployment ~15-35 s and its tests ~6 s, teardown ~10 s).
"""

from __future__ import annotations

import json
import threading
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
from tests.support.ray_cluster import fleet_server  # noqa: E402
from tests.support.server import ServerProcess, free_port  # noqa: E402
from tests.support.tiny_llm import build_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = "sample-model"
STREAMS = 16
PROMPT = [5, 17, 29, 41]


@pytest.fixture(scope="module")
def fail_on(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray-admin") / "fail-on.txt"


@pytest.fixture(scope="module")
def server(
    cluster: Cluster, fail_on: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    engine = ["--engine", "tests.support.doubles:FleetUpdateFailingEngine"]
    engine += ["--", "--fail-on", str(fail_on), "--delay", "0.02"]
    with fleet_server(cluster, tmp_path_factory.mktemp("ray-server"), engine) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as opened:
        yield opened


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The served checkpoint, another with other weights, one with wrong shapes."""
    served = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    other = build_tiny_llama(tmp_path_factory.mktemp("tiny-other"), seed=1, tokenizer_from=served)
    from transformers import LlamaForCausalLM

    wider = tmp_path_factory.mktemp("tiny-wider")
    config = LlamaForCausalLM.from_pretrained(other).config
    config.hidden_size = 96
    LlamaForCausalLM(config).save_pretrained(wider)
    return served, other, wider


@pytest.fixture(scope="module")
def tiny_client(
    cluster: Cluster,
    tiny_models: tuple[Path, Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[httpx.Client]:
    args = ["--ray-app-name", "penstock-tiny", "--engine", "transformers"]
    args += ["--model", str(tiny_models[0]), "--", "--cpu-threads", "1"]
    log_dir = tmp_path_factory.mktemp("ray-tiny")
    with (
        fleet_server(cluster, log_dir, args, ready_timeout=180) as process,
        httpx.Client(base_url=process.base_url, timeout=60) as opened,
    ):
        yield opened


def checksums(client: httpx.Client) -> set[str]:
    answer = client.post("/engine/control/weights_checksum", json={}).json()
    return {replica["checksum"] for replica in answer["replicas"].values()}


def fleet_view(client: httpx.Client, want: Any = None) -> dict[str, Any]:
    """``/health``'s fleet once both replicas report (and ``want(view)`` holds)."""
    deadline = time.monotonic() + 30
    while True:
        view = client.get("/health").json()["fleet"]
        replicas = view["replicas"]
        ready = len(replicas) == 2 and all("weight_version" in r for r in replicas.values())
        if ready and (want is None or want(view)):
            return view
        assert time.monotonic() < deadline, view
        time.sleep(0.2)


def stream_versions(client: httpx.Client, out: list[tuple[str, set[Any]]]) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 150, "stream": True}
    versions: set[Any] = set()
    last = ""
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not line:
                continue
            last = line
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                versions.add(chunk.get("weight_version"))
    out.append((last, versions))


def test_capabilities_and_health_describe_every_replica(client: httpx.Client) -> None:
    view = fleet_view(client)
    for replica in view["replicas"].values():
        assert replica["state"] == "running" and replica["paused"] is None
        assert replica["running"] == 0
    capabilities = client.get("/engine/capabilities").json()
    assert set(capabilities["fleet"]["replicas"]) == set(view["replicas"])
    methods = capabilities["weight_sync"]["methods"]
    assert {
        "update_weights_from_disk",
        "update_weights_from_tensor",
        "update_weights_from_nixl",
    } <= set(methods)


def test_one_update_call_under_streams_moves_every_replica_together(
    client: httpx.Client, tmp_path: Path
) -> None:
    before = client.get("/engine/get_weight_version").json()["version"]
    weights = write_sample_weights(tmp_path / "v1.safetensors", 3)
    results: list[tuple[str, set[Any]]] = []
    threads = [
        threading.Thread(target=stream_versions, args=(client, results)) for _ in range(STREAMS)
    ]
    for thread in threads:
        thread.start()
    fleet_view(client, lambda v: sum(r["running"] for r in v["replicas"].values()) >= STREAMS)

    # No pause first: the fleet transaction pauses and resumes every replica itself.
    answer = client.post(
        "/engine/update_weights_from_disk",
        json={"model_path": str(weights), "weight_version": "v1"},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["version"] == "v1" and answer.json()["state"] == "serving"
    for thread in threads:
        thread.join()
    assert len(results) == STREAMS
    assert all(last == "data: [DONE]" for last, _ in results)
    assert set().union(*(versions for _, versions in results)) <= {before, "v1"}

    checked = client.post("/engine/control/weights_checksum", json={}).json()
    assert len({r["checksum"] for r in checked["replicas"].values()}) == 1
    assert checked["checksum"] == answer.json()["checksum"]
    view = fleet_view(client, lambda v: v["weight_versions"] == ["v1"])
    assert all(r["paused"] is None for r in view["replicas"].values())
    done = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert done.json()["weight_version"] == "v1"


def test_pause_tensor_update_resume_through_the_sglang_routes(client: httpx.Client) -> None:
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    view = fleet_view(client, lambda v: all(r["paused"] for r in v["replicas"].values()))
    assert client.get("/health").status_code == 503
    pushed = client.post(
        "/update_weights_from_tensor",
        json={"named_tensors": {"token_shift": [5]}, "weight_version": "v2"},
    )
    assert pushed.status_code == 200, pushed.text
    # Still paused: the transaction leaves the replicas as the trainer's pause left them.
    view = fleet_view(client, lambda v: v["weight_versions"] == ["v2"])
    assert all(r["paused"] == "abort" for r in view["replicas"].values())
    assert client.post("/continue_generation", json={}).status_code == 200
    flushed = client.post("/engine/control/flush_cache", json={}).json()
    assert len(flushed["replicas"]) == 2
    versions = client.get("/engine/get_weight_version").json()
    assert versions["version"] == "v2"


def test_a_replica_that_fails_the_update_rolls_the_whole_fleet_back(
    client: httpx.Client, fail_on: Path, tmp_path: Path
) -> None:
    before = client.post("/engine/control/weights_checksum", json={}).json()["checksum"]
    victim = sorted(fleet_view(client)["replicas"])[0]
    fail_on.write_text(victim)
    try:
        weights = write_sample_weights(tmp_path / "v3.safetensors", 7)
        answer = client.post(
            "/engine/update_weights_from_disk",
            json={"model_path": str(weights), "weight_version": "v3"},
        )
    finally:
        fail_on.write_text("")
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "engine_rejected" and error["param"] == "model_path"
    assert error["failed_replica"] == victim and victim in error["message"]
    assert "refused on purpose" in error["replicas"][victim]["error"]["message"]
    other = next(name for name in error["replicas"] if name != victim)
    assert error["replicas"][other]["ok"] and error["replicas"][other]["rolled_back"]
    assert {r["checksum"] for r in error["replicas"].values()} == {before}
    assert {r["weight_version"] for r in error["replicas"].values()} == {"v2"}

    assert client.get("/engine/get_weight_version").json()["version"] == "v2"
    checked = client.post("/engine/control/weights_checksum", json={}).json()
    assert {r["checksum"] for r in checked["replicas"].values()} == {before}
    view = fleet_view(client, lambda v: all(r["paused"] is None for r in v["replicas"].values()))
    assert view["weight_versions"] == ["v2"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 4}
    assert client.post("/v1/completions", json=body).json()["weight_version"] == "v2"


def test_a_nixl_pull_reaches_every_replica_and_one_refusal_rolls_all_back(
    client: httpx.Client, fail_on: Path
) -> None:
    """The trainer (this process) registers ``token_shift`` with its NIXL agent; each
    replica READs it itself inside one transaction. With one replica refusing, the other
    has already read the new value and is put back (about 3 s: both replicas make their
    NIXL agents)."""
    import torch

    from penstock.rl.trainer import EngineRefused, WeightPusher

    pushed = {"token_shift": torch.tensor([9], dtype=torch.int64)}
    pusher = WeightPusher(str(client.base_url))
    try:
        reply = pusher.push_nixl(pushed, weight_version="n1")
        assert reply["checksum"] == pusher.checksum(pushed) and reply["weight_version"] == "n1"
        assert checksums(client) == {reply["checksum"]}
        # The transaction paused both replicas itself, so it resumed them.
        view = fleet_view(
            client,
            lambda v: (
                v["weight_versions"] == ["n1"]
                and all(r["paused"] is None for r in v["replicas"].values())
            ),
        )

        victim = sorted(view["replicas"])[1]
        fail_on.write_text(victim)
        try:
            with pytest.raises(EngineRefused) as refused:
                pusher.push_nixl(
                    {"token_shift": torch.tensor([4], dtype=torch.int64)}, weight_version="n2"
                )
        finally:
            fail_on.write_text("")
    finally:
        pusher.close()
    assert refused.value.status_code == 400, refused.value.body
    error = refused.value.body["error"]
    assert error["failed_replica"] == victim
    other = next(name for name in error["replicas"] if name != victim)
    assert error["replicas"][other]["ok"] and error["replicas"][other]["rolled_back"]
    assert {r["checksum"] for r in error["replicas"].values()} == {reply["checksum"]}
    assert {r["weight_version"] for r in error["replicas"].values()} == {"n1"}
    assert checksums(client) == {reply["checksum"]}
    fleet_view(client, lambda v: v["weight_versions"] == ["n1"])


def test_transformers_replicas_update_from_disk_together_and_roll_back_together(
    tiny_client: httpx.Client, tiny_models: tuple[Path, Path, Path]
) -> None:
    _, other, wider = tiny_models
    (before,) = checksums(tiny_client)
    answer = tiny_client.post(
        "/engine/update_weights_from_disk",
        json={"model_path": str(other), "weight_version": "t1"},
    )
    assert answer.status_code == 200, answer.text
    (after,) = checksums(tiny_client)
    assert after != before and answer.json()["version"] == "t1"

    refused = tiny_client.post(
        "/engine/update_weights_from_disk",
        json={"model_path": str(wider), "weight_version": "t2"},
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "shapes do not match" in error["message"] and error["failed_replica"]
    assert {r["checksum"] for r in error["replicas"].values()} == {after}
    assert checksums(tiny_client) == {after}
    chat = {"model": tiny_client.get("/v1/models").json()["data"][0]["id"], "max_tokens": 3}
    chat["messages"] = [{"role": "user", "content": "hi"}]
    assert tiny_client.post("/v1/chat/completions", json=chat).json()["weight_version"] == "t1"


def fleet_greedy(client: httpx.Client, count: int) -> list[list[int]]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    replies = [client.post("/generate", json=body) for _ in range(count)]
    assert all(reply.status_code == 200 for reply in replies), replies[0].text
    return [reply.json()["output_ids"] for reply in replies]


def test_a_trainer_broadcasts_to_every_replica_in_one_group(
    tiny_client: httpx.Client, tiny_models: tuple[Path, Path, Path]
) -> None:
    """The trainer (this process) is rank 0 of a gloo group of 1 + 2 ranks, one per
    replica; one broadcast updates both inside the fleet transaction, and a refused one
    rolls both back (about 5 s on two cores)."""
    import torch
    from transformers import LlamaForCausalLM

    from penstock.rl.trainer import EngineRefused, WeightPusher

    model = LlamaForCausalLM.from_pretrained(tiny_models[1], torch_dtype=torch.float32)
    (served,) = checksums(tiny_client)
    before = fleet_greedy(tiny_client, 1)[0]
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    state = {name: t.detach() for name, t in model.state_dict().items()}
    pusher = WeightPusher(str(tiny_client.base_url))
    try:
        assert pusher.engine_ranks() == 2
        joined = pusher.init_group("127.0.0.1", free_port(), timeout_s=20)
        assert joined["message"] == "2 replicas joined as ranks 1..2 of 3", joined
        reply = pusher.broadcast(state, weight_version="b1")
        assert reply["checksum"] == pusher.checksum(state, dtype=torch.float32)
        assert checksums(tiny_client) == {reply["checksum"]}
        assert tiny_client.get("/engine/get_weight_version").json()["version"] == "b1"
        with torch.no_grad():
            out = model.generate(
                torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8
            )
        expected = [int(t) for t in out[0, len(PROMPT) :]]
        assert expected != before
        assert fleet_greedy(tiny_client, 4) == [expected] * 4

        bad = {next(iter(state)): torch.zeros(3, 5)}
        with pytest.raises(EngineRefused) as refused:
            pusher.broadcast(bad, weight_version="b2")
        assert refused.value.status_code == 400, refused.value.body
        assert checksums(tiny_client) == {reply["checksum"]} != {served}
        assert tiny_client.get("/engine/get_weight_version").json()["version"] == "b1"
    finally:
        pusher.destroy_group()
        pusher.close()


def test_a_trainer_serves_one_nixl_pull_to_every_replica(
    tiny_client: httpx.Client, tiny_models: tuple[Path, Path, Path]
) -> None:
    """Each replica READs the whole model from the trainer's (this process's) NIXL agent
    in one fleet transaction; a push of a wrong shape leaves both on the pushed weights
    (about 1 s on two cores)."""
    import torch
    from transformers import LlamaForCausalLM

    from penstock.rl.trainer import EngineRefused, WeightPusher

    model = LlamaForCausalLM.from_pretrained(tiny_models[1], torch_dtype=torch.float32)
    (served,) = checksums(tiny_client)
    torch.manual_seed(4)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    state = {name: t.detach() for name, t in model.state_dict().items()}
    pusher = WeightPusher(str(tiny_client.base_url))
    try:
        reply = pusher.push_nixl(state, weight_version="x1")
        assert reply["checksum"] == pusher.checksum(state, dtype=torch.float32) != served
        assert checksums(tiny_client) == {reply["checksum"]}
        assert fleet_view(tiny_client)["weight_versions"] == ["x1"]

        name = next(iter(state))
        with pytest.raises(EngineRefused) as refused:
            pusher.push_nixl({name: torch.zeros(3, 5)}, weight_version="x2")
    finally:
        pusher.close()
    assert refused.value.status_code == 400, refused.value.body
    error = refused.value.body["error"]
    assert name in error["message"] and error["failed_replica"]
    assert {r["checksum"] for r in error["replicas"].values()} == {reply["checksum"]}
    assert {r["weight_version"] for r in error["replicas"].values()} == {"x1"}
    assert checksums(tiny_client) == {reply["checksum"]}
    assert tiny_client.get("/engine/get_weight_version").json()["version"] == "x1"


def test_a_lora_adapter_loads_on_every_replica(client: httpx.Client, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    write_sample_weights(tmp_path / "adapter_model.safetensors", 11)
    loaded = client.post(
        "/engine/update/load_lora", json={"lora_name": "shifted", "lora_path": str(tmp_path)}
    )
    assert loaded.status_code == 200, loaded.text
    before = {name: r["served"] for name, r in fleet_view(client)["replicas"].items()}
    body = {"model": "shifted", "prompt": "x", "max_tokens": 20}
    texts: list[str] = []

    def ask() -> None:
        texts.append(client.post("/v1/completions", json=body).json()["choices"][0]["text"])

    # Concurrent requests spread over both replicas; each must have the adapter.
    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    base = client.post("/v1/completions", json={**body, "model": MODEL}).json()
    assert len(texts) == 8 and len(set(texts)) == 1
    assert base["choices"][0]["text"] != texts[0]
    after = fleet_view(client)["replicas"]
    assert all(after[name]["served"] > served for name, served in before.items()), after


def test_a_replacement_replica_serves_only_once_on_the_fleets_weights(
    client: httpx.Client, tmp_path: Path
) -> None:
    """After a fleet disk update one replica is killed: Ray's replacement starts on the
    checkpoint's weights, so it gets no request until it has taken its peer's weights and
    reports the fleet's checksum and version (about 10-20 s)."""
    weights = write_sample_weights(tmp_path / "v4.safetensors", 5)
    answer = client.post(
        "/engine/update_weights_from_disk",
        json={"model_path": str(weights), "weight_version": "v4"},
    )
    assert answer.status_code == 200, answer.text
    fleet_checksum = answer.json()["checksum"]
    before = fleet_view(client, lambda v: v["weight_versions"] == ["v4"])["replicas"]
    assert all(r["in_rotation"] for r in before.values())
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    versions: set[Any] = set()
    newcomer: str | None = None
    deadline = time.monotonic() + 90
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    while time.monotonic() < deadline:
        reply = client.post("/v1/completions", json=body)
        if reply.status_code == 200:
            versions.add(reply.json()["weight_version"])
        else:
            assert reply.json()["error"]["code"] == "replica_lost", reply.text
        replicas = client.get("/health").json()["fleet"]["replicas"]
        # A dying replica may answer a status call as failed, with no state.
        fresh = {n: r for n, r in replicas.items() if n not in before and "state" in r}
        for name, replica in fresh.items():
            newcomer = name
            if not replica["in_rotation"]:
                assert replica["served"] == 0, replica
                assert "not yet on its weights" in replica["out_of_rotation"], replica
        if newcomer is not None and fresh[newcomer]["served"] > 0:
            break
        time.sleep(0.1)
    assert newcomer is not None and fresh[newcomer]["served"] > 0, replicas
    # The replacement starts on the checkpoint's version: a request it served before
    # the replay would carry that.
    assert versions == {"v4"}
    checked = client.post("/engine/control/weights_checksum", json={}).json()
    assert checked["replicas"][newcomer]["checksum"] == fleet_checksum
    assert replicas[newcomer]["weight_version"] == "v4"
