"""``/v1/embeddings`` on ``penstock serve --engine transformers-pooling`` under a large
batch: a one-input request is answered before the batch beside it, not after all of it,
and a batch whose client left runs no further pass: the server's CPU time after the
client left is a small part of what the batch costs when run alone in the same test."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess, running_server
from tests.support.tiny_llm import build_tiny_llama

# Inputs of the large batch, each of INPUT_TOKENS tokens: many passes of 4 inputs each.
BATCH = 160
INPUT_TOKENS = 500


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder: Path = build_tiny_llama(tmp_path_factory.mktemp("llama"))
    args = ["--engine", "transformers-pooling", "--model", str(folder)]
    engine = ["--", "--cpu-threads", "1", "--max-batch-tokens", "2048"]
    log_dir = tmp_path_factory.mktemp("serve")
    with running_server(
        [*args, *engine], log_dir, env={"HF_HUB_OFFLINE": "1"}, ready_timeout=120
    ) as process:
        yield process


def embed(server: ServerProcess, inputs: list[list[int]], timeout: float = 300) -> float:
    """Seconds until the answer (or until ``timeout``, when the client gives up)."""
    model = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    started = time.monotonic()
    try:
        reply = httpx.post(
            f"{server.base_url}/v1/embeddings",
            json={"model": model, "input": inputs},
            timeout=timeout,
        )
        assert reply.status_code == 200, reply.text[:300]
    except httpx.TimeoutException:
        pass
    return time.monotonic() - started


def large_batch(seed: int) -> list[list[int]]:
    return [[(seed + 7 * i + j) % 1_900 + 50 for j in range(INPUT_TOKENS)] for i in range(BATCH)]


def cpu_seconds(server: ServerProcess) -> float:
    """The CPU time the server's process has used (``/proc/<pid>/stat``)."""
    stat = Path(f"/proc/{server.process.pid}/stat").read_text()
    fields = stat.rpartition(")")[2].split()
    user, system = int(fields[11]), int(fields[12])
    return (user + system) / os.sysconf("SC_CLK_TCK")


def test_a_small_request_takes_turns_with_a_large_batch_and_a_left_batch_stops(
    server: ServerProcess,
) -> None:
    small = [[5, 6, 7, 8]]
    embed(server, small)
    before = cpu_seconds(server)
    alone = embed(server, large_batch(1))
    batch_cpu = cpu_seconds(server) - before
    answered: list[str] = []

    def embed_beside() -> None:
        embed(server, large_batch(2))
        answered.append("batch")

    beside = threading.Thread(target=embed_beside)
    beside.start()
    time.sleep(alone * 0.2)
    embed(server, small)
    answered.append("small")
    beside.join()
    assert answered == ["small", "batch"]
    # The client gives up early in the batch; the passes it left must not run, for as
    # long as the whole batch took alone.
    embed(server, large_batch(3), timeout=alone * 0.1)
    left_at = cpu_seconds(server)
    time.sleep(alone)
    after_leaving = cpu_seconds(server) - left_at
    assert after_leaving < batch_cpu * 0.25, (after_leaving, batch_cpu)
