"""Overload answers tell the truth, against a real ``penstock serve --engine sample``.

A batch the server can never hold is a 400, not a retryable overload; shed requests are
summed up in one WARNING line per interval; clients that go away, admitted or queued,
are counted as cancelled and never as internal errors.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
LOG_INTERVAL_S = 0.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--engine", "sample", "--max-concurrency", "2", "--max-queue", "3", "--max-n", "8"]
    args += ["--overload-log-interval-s", str(LOG_INTERVAL_S), "--", "--delay", "0.02"]
    with running_server(args, tmp_path_factory.mktemp("overload")) as process:
        yield process


def outcomes(server: ServerProcess) -> dict[str, float]:
    """``requests_total`` summed by ``error_type`` over every endpoint and request type."""
    found: dict[str, float] = {}
    text = httpx.get(f"{server.base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name != "penstock_frontend_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                kind = sample.labels["error_type"] or "success"
                found[kind] = found.get(kind, 0) + sample.value
    return found


def test_a_batch_larger_than_the_server_holds_is_a_400_naming_the_limit(
    server: ServerProcess,
) -> None:
    url = f"{server.base_url}/v1/completions"
    too_many = httpx.post(url, json={"model": MODEL, "prompt": ["x"] * 6, "max_tokens": 2})
    assert too_many.status_code == 400
    assert "retry-after" not in too_many.headers
    error = too_many.json()["error"]
    assert error["param"] == "prompt"
    assert "6 prompts" in error["message"] and "at most 5" in error["message"]
    assert "max_concurrency 2" in error["message"] and "max_queue 3" in error["message"]
    fits = httpx.post(url, json={"model": MODEL, "prompt": ["x"] * 5, "max_tokens": 2})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 5
    # The choices of one prompt share one engine request, so n is not bounded by the gate.
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 8},
    )
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 8


def test_shed_requests_are_summed_up_in_one_warning_line(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 10}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(12))
            )
        return [response.status_code for response in responses]

    statuses = asyncio.run(burst())
    shed = statuses.count(529)
    assert shed >= 7 and statuses.count(200) == 12 - shed
    deadline = time.monotonic() + 10 * LOG_INTERVAL_S
    summary = f"shed {shed} requests in the last {LOG_INTERVAL_S:g}s"
    while summary not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in server.log().splitlines() if summary in line]
    assert lines, server.log()[-2000:]
    assert "WARNING" in lines[0] and "(queue full: max_concurrency=2, max_queue=3)" in lines[0]
    assert not [line for line in server.log().splitlines() if "ERROR" in line]


def test_clients_that_go_away_are_counted_as_cancelled_never_internal(
    server: ServerProcess,
) -> None:
    rng = random.Random(7)
    before = outcomes(server)

    async def client(http: httpx.AsyncClient) -> None:
        stream = rng.random() < 0.5
        if rng.random() < 0.3:
            path = "/v1/chat/completions"
            body: dict = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        else:
            path = "/v1/completions"
            body = {"model": MODEL, "prompt": "x" if rng.random() < 0.7 else ["a", "b"]}
        body |= {"max_tokens": 20, "stream": stream}
        # Each request takes ~0.4 s once admitted; leaving within that catches it running,
        # waiting in the queue, or between the two.
        start, leave = rng.uniform(0, 0.8), rng.uniform(0.02, 0.5)
        await asyncio.sleep(start)
        try:
            async with asyncio.timeout(leave):
                async with http.stream("POST", path, json=body) as response:
                    async for _ in response.aiter_bytes():
                        pass
        except TimeoutError:
            pass

    async def rounds() -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30, limits=limits) as http:
            for _ in range(4):
                await asyncio.gather(*(client(http) for _ in range(24)))

    asyncio.run(rounds())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = outcomes(server)
        gauge = httpx.get(f"{server.base_url}/metrics").text
        if f'penstock_frontend_active_requests{{model="{MODEL}"}} 0.0' in gauge:
            break
        time.sleep(0.1)
    cancelled = after.get("cancelled", 0) - before.get("cancelled", 0)
    assert after.get("internal", 0) == 0, after
    assert cancelled >= 30, after
    ok = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
    )
    assert ok.status_code == 200
