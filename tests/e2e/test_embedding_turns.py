"""``/v1/embeddings`` on ``penstock serve --engine transformers-pooling`` under a large
batch: a one-input request waits for a pass of it, not for all of it, and a batch whose
client left runs no further pass. Times are ratios against the large batch run alone in
the same test."""

from __future__ import annotations

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


def test_a_small_request_takes_turns_with_a_large_batch_and_a_left_batch_stops(
    server: ServerProcess,
) -> None:
    small = [[5, 6, 7, 8]]
    embed(server, small)
    alone = embed(server, large_batch(1))
    beside = threading.Thread(target=embed, args=(server, large_batch(2)))
    beside.start()
    time.sleep(alone * 0.1)
    waited = embed(server, small)
    beside.join()
    # The client gives up early in the batch; a request right after it must not wait
    # for the rest of the batch's passes.
    embed(server, large_batch(3), timeout=alone * 0.1)
    after_leaving = embed(server, small)
    print(
        f"batch {alone:.2f} s; small beside it {waited:.2f} s, after one left {after_leaving:.2f} s"
    )
    assert waited < alone * 0.4
    assert after_leaving < alone * 0.4
