"""``penstock serve --ray`` on a local two-node Ray cluster: two replicas of the sample
engine behind one gateway.

The module starts one server on the package's cluster (``tests/ray/conftest.py``, ~7 s
to start for the first module that asks for it); the whole module takes about 40-60 s on
two cores (deployment ~10 s, replacing a killed replica ~10 s, teardown ~5 s).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip(
    "ray", reason="Ray Serve is not installed: pip install 'penstock[ray]' to run tests/ray"
)
from openai import OpenAI  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tests.support.ray_cluster import fleet_replicas, fleet_server  # noqa: E402
from tests.support.server import ServerProcess, start_server  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = "sample-model"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray-engine") / "engine.txt"


@pytest.fixture(scope="module")
def server(
    cluster: Cluster, marker: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    engine = ["--engine", "tests.support.doubles:AbortRecordingEngine"]
    engine += ["--", "--marker", str(marker), "--delay", "0.02"]
    with fleet_server(cluster, tmp_path_factory.mktemp("ray-server"), engine) as process:
        yield process


def stream_lines(
    server: ServerProcess, max_tokens: int, out: list[list[str]], streaming: threading.Semaphore
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
    ) as response:
        lines = []
        for line in response.iter_lines():
            if line:
                if not lines:
                    streaming.release()
                lines.append(line)
        out.append(lines)


def run_streams(server: ServerProcess, count: int, max_tokens: int) -> list[threading.Thread]:
    """``count`` streams in threads; the first's ``results`` collects every stream's lines
    and its ``streaming`` is released once per stream whose first line has arrived."""
    results: list[list[str]] = []
    streaming = threading.Semaphore(0)
    threads = [
        threading.Thread(target=stream_lines, args=(server, max_tokens, results, streaming))
        for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    threads[0].results = results  # type: ignore[attr-defined]
    threads[0].streaming = streaming  # type: ignore[attr-defined]
    return threads


def test_chat_and_completions_stream_and_not_through_the_openai_client(
    server: ServerProcess,
) -> None:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    pieces = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
    assert text == chat.choices[0].message.content
    completion = client.completions.create(model=MODEL, prompt="x", max_tokens=4, n=2)
    assert [choice.finish_reason for choice in completion.choices] == ["length", "length"]
    streamed = client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == completion.choices[0].text


def test_concurrent_requests_spread_over_both_replicas(server: ServerProcess) -> None:
    before = fleet_replicas(server)
    threads = run_streams(server, 6, 25)
    for thread in threads:
        thread.join()
    results = threads[0].results  # type: ignore[attr-defined]
    assert len(results) == 6 and all(lines[-1] == "data: [DONE]" for lines in results)
    after = fleet_replicas(server)
    served = {
        name: load["served"] - before.get(name, {}).get("served", 0) for name, load in after.items()
    }
    assert len([n for n in served.values() if n > 0]) == 2, after
    assert all(load["running"] == 0 for load in after.values())


def test_a_client_disconnect_aborts_once_on_its_replica(
    server: ServerProcess, marker: Path
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1500, "stream": True}
    headers = {"X-Request-Id": "ray-leaving-early"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30
    ) as response:
        lines = response.iter_lines()
        next(lines)
        next(lines)
    deadline = time.monotonic() + 10
    while "abort ray-leaving-early" not in marker.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert marker.read_text().splitlines().count("abort ray-leaving-early") == 1


def test_a_killed_replica_fails_only_its_own_requests_and_is_replaced(
    server: ServerProcess,
) -> None:
    threads = run_streams(server, 4, 150)
    # Every response under way (its first line read): a replica lost before a request's
    # first token answers that request with an error status instead, not an error frame.
    streaming = threads[0].streaming  # type: ignore[attr-defined]
    assert all(streaming.acquire(timeout=30) for _ in threads)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = {name: load["running"] for name, load in fleet_replicas(server).items()}
        if sum(running.values()) == 4:
            break
        time.sleep(0.05)
    victim = max(running, key=lambda name: running[name])
    lost = running[victim]
    assert 0 < lost < 4, running
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join()
    results = threads[0].results  # type: ignore[attr-defined]
    assert all(lines[-1] == "data: [DONE]" for lines in results)
    failed = [json.loads(lines[-2][len("data: ") :]) for lines in results if "error" in lines[-2]]
    assert len(failed) == lost
    assert all(frame["error"]["code"] == "replica_lost" for frame in failed)

    deadline = time.monotonic() + 60
    replaced: set[str] = set()
    while time.monotonic() < deadline and not replaced:
        done = run_streams(server, 4, 10)
        for thread in done:
            thread.join()
        outcome = done[0].results  # type: ignore[attr-defined]
        assert all(lines[-1] == "data: [DONE]" for lines in outcome)
        replaced = {
            name
            for name, load in fleet_replicas(server).items()
            if name not in running and load["served"]
        }
        time.sleep(0.5)
    assert replaced, fleet_replicas(server)
    # The dead replica has left the fleet's view, /health and the metrics.
    health = httpx.get(f"{server.base_url}/health", timeout=10).json()["fleet"]
    assert victim not in health["replicas"] and len(health["replicas"]) == health["size"] == 2
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert victim not in metrics and all(name in metrics for name in health["replicas"])
    assert all(entry["checksum"] for entry in health["replicas"].values())


def test_a_replica_that_cannot_start_stops_startup_with_its_reason(
    cluster: Cluster, tmp_path: Path
) -> None:
    # No CPU asked: the module's server holds both of the cluster's.
    args = ["--ray", "--ray-address", cluster.address, "--ray-app-name", "unstartable"]
    args += ["--ray-replica-cpus", "0"]
    args += ["--engine", "no_such_engine"]
    server = start_server(args, tmp_path, wait_ready=False)
    assert server.process.wait(timeout=120) == 1
    log = server.log()
    assert "the engine deployment on Ray failed to start" in log
    assert "unknown engine 'no_such_engine'" in log
    assert "unstartable" not in serve.status().applications
