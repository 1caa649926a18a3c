"""Admission gate: cap, FIFO queue, refusal when full, no slot leaked on cancel."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from penstock.engines.admission import AdmissionGate
from penstock.errors import OverloadedError
from tests.support.server import running_server


async def test_waiters_get_freed_slots_in_arrival_order() -> None:
    gate = AdmissionGate(max_active=1, max_queued=2)
    await gate.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await gate.acquire()
        order.append(name)

    first = asyncio.create_task(wait("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    assert gate.queued == 2
    with pytest.raises(OverloadedError) as refused:
        await gate.acquire()
    assert refused.value.headers["Retry-After"] == "1"
    gate.release()
    await first
    gate.release()
    await second
    assert order == ["first", "second"]
    gate.release()
    assert gate.active == 0


async def test_a_cancelled_waiter_leaks_no_slot() -> None:
    gate = AdmissionGate(max_active=1, max_queued=1, overload_status=503)
    await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert gate.queued == 0
    gate.release()
    assert gate.active == 0
    await gate.acquire()
    assert gate.active == 1


def test_requests_beyond_cap_and_queue_get_the_overload_status(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--max-concurrency", "1", "--max-queue", "1"]
    args += ["--", "--delay", "0.05"]
    with running_server(args, tmp_path) as server:
        body = {"model": "sample-model", "prompt": "x", "max_tokens": 10}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
                return await asyncio.gather(
                    *(client.post("/v1/completions", json=body) for _ in range(3))
                )

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 200, 529]
        refused = next(r for r in responses if r.status_code == 529)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "overloaded_error"
        assert httpx.post(f"{server.base_url}/v1/completions", json=body).status_code == 200


async def test_a_waiter_cancelled_after_a_release_skipped_it_is_still_cancelled() -> None:
    gate = AdmissionGate(max_active=1, max_queued=2)
    await gate.acquire()
    leaving = asyncio.create_task(gate.acquire())
    staying = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    # The cancel reaches the waiter at once but its task only resumes later, after the
    # release has already dropped the dead waiter and handed the slot on.
    leaving.cancel()
    gate.release()
    await staying
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert (gate.active, gate.queued) == (1, 0)
