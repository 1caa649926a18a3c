"""vLLM's ``priority`` against ``penstock serve --engine transformers`` on the tiny Llama:
honoured only with ``--scheduling-policy priority`` (as vLLM's own flag), and even then a
client keeping the queue full of urgent requests cannot starve another's."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess, running_servers, transformers_args
from tests.support.tiny_llm import build_tiny_llama

# The crowd: more requests in flight than the engine runs at once, each resent as soon as
# it is answered, so some always wait.
ROWS = 4
CROWD = 12
CROWD_TOKENS = 16


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """One server as started by default, one with ``--scheduling-policy priority``."""
    model_dir: Path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    rows = ("--max-num-seqs", str(ROWS))
    starts = [
        (transformers_args(model_dir, engine_args=rows), tmp_path_factory.mktemp("fcfs")),
        (
            transformers_args(model_dir, "--scheduling-policy", "priority", engine_args=rows),
            tmp_path_factory.mktemp("priority"),
        ),
    ]
    with running_servers(starts, env={"HF_HUB_OFFLINE": "1"}, ready_timeout=180) as started:
        yield started


def completion(priority: int, max_tokens: int) -> dict[str, object]:
    return {
        "model": "tiny-llama",
        "prompt": [5, 17, 42, 9],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "priority": priority,
    }


def test_without_the_priority_policy_a_priority_is_refused_as_in_vllm(
    servers: list[ServerProcess],
) -> None:
    model = httpx.get(f"{servers[0].base_url}/v1/models").json()["data"][0]["id"]
    body = {**completion(-10, 2), "model": model}
    refused = httpx.post(f"{servers[0].base_url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]
    plain = httpx.post(
        f"{servers[0].base_url}/v1/completions", json={**body, "priority": 0}, timeout=60
    )
    assert plain.status_code == 200, plain.text


async def latency_beside_crowd(base_url: str, crowd_priority: int, patience: float) -> float:
    """Seconds a short request at the default priority takes while the crowd, at
    ``crowd_priority``, keeps the engine's queue full; ``inf`` when none came in
    ``patience`` seconds."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        stop = asyncio.Event()

        async def member() -> None:
            while not stop.is_set():
                body = {**completion(crowd_priority, CROWD_TOKENS), "model": model}
                answer = await http.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text

        crowd = [asyncio.ensure_future(member()) for _ in range(CROWD)]
        await asyncio.sleep(0.3)
        started = time.monotonic()
        try:
            body = {**completion(0, 5), "model": model}
            answer = await http.post("/v1/completions", json=body, timeout=patience)
            assert answer.status_code == 200, answer.text
            elapsed = time.monotonic() - started
        except httpx.TimeoutException:
            elapsed = float("inf")
        stop.set()
        await asyncio.gather(*crowd)
        return elapsed


def test_an_urgent_crowd_delays_another_request_only_boundedly(
    servers: list[ServerProcess],
) -> None:
    base_url = servers[1].base_url
    # The same crowd at the default priority: the request waits its turn behind it.
    baseline = statistics.median(
        asyncio.run(latency_beside_crowd(base_url, 0, 600)) for _ in range(3)
    )
    # At a lower priority value every request the crowd resends goes ahead of it; it
    # still runs once two batches' worth of them have.
    starved = asyncio.run(latency_beside_crowd(base_url, -10, 20 * baseline))
    assert starved < 6 * baseline, (starved, baseline)
