"""A cancel-safe engine runs in its consumer's task: what the host still guarantees."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    WorkerConfig,
)
from penstock.engines.host import EngineHost
from penstock.errors import EngineError
from tests.support.doubles import ScriptedEngine


class CancelSafeEngine(ScriptedEngine):
    """Advertises ``CANCEL_SAFE_RUNTIME_KEY``; records how each stream ended, and in
    which task it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.endings: dict[str, str] = {}
        self.tasks: dict[str, asyncio.Task[Any] | None] = {}

    async def start(self, worker_id: int) -> EngineConfig:
        config = await super().start(worker_id)
        config.runtime_data = {CANCEL_SAFE_RUNTIME_KEY: True}
        return config

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        self.tasks[context.id()] = asyncio.current_task()
        ending = "ran to its end"
        try:
            async for chunk in super().generate(request, context):
                yield chunk
        except asyncio.CancelledError:
            ending = "cancelled at an await"
            raise
        except GeneratorExit:
            ending = "closed at a yield"
            raise
        finally:
            self.endings[context.id()] = ending


async def started() -> tuple[EngineHost, CancelSafeEngine]:
    engine = CancelSafeEngine()
    host = EngineHost(engine, WorkerConfig(namespace="test"))
    await host.start()
    return host, engine


def request(mode: str = "ok") -> dict[str, Any]:
    return {"token_ids": [1, 2], "extra_args": {"mode": mode}}


async def test_the_engine_runs_in_the_consumers_task_and_is_closed_after_its_terminal() -> None:
    host, engine = await started()
    chunks = [c async for c in host.generate(request(), Context("done"))]
    await asyncio.sleep(0.05)
    assert engine.tasks["done"] is asyncio.current_task()
    assert [c["token_ids"] for c in chunks] == [[5], [7]]
    assert chunks[-1]["finish_reason"] == "length"
    assert engine.endings["done"] == "closed at a yield"
    assert engine.aborted == []


async def test_a_consumer_closing_the_stream_closes_the_engine_and_aborts_once() -> None:
    host, engine = await started()
    context = Context("gone")
    stream = host.generate(request("slow"), context)
    await anext(stream)
    await stream.aclose()
    host.cancel(context)
    await asyncio.sleep(0.05)
    assert engine.endings["gone"] == "closed at a yield"
    assert engine.aborted == ["gone"]
    assert context.is_killed()


async def test_a_cancelled_consumer_cancels_the_engine_and_aborts_once() -> None:
    host, engine = await started()
    context = Context("task")

    async def consume() -> None:
        async for _ in host.generate(request("slow"), context):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    assert engine.endings["task"] == "cancelled at an await"
    assert engine.aborted == ["task"]
    assert context.is_killed()


async def test_a_stop_mark_ends_the_stream_with_cancelled_and_aborts_once() -> None:
    host, engine = await started()
    context = Context("stopped")
    chunks = []
    async for chunk in host.generate(request("slow"), context):
        chunks.append(chunk)
        if len(chunks) == 3:
            host.cancel(context)
            host.cancel(context)
    await asyncio.sleep(0.05)
    assert chunks[-1]["finish_reason"] == "cancelled"
    assert engine.aborted == ["stopped"]


async def test_an_engine_error_is_one_error_and_others_keep_running() -> None:
    host, _ = await started()

    async def drain(mode: str) -> list[dict]:
        return [c async for c in host.generate(request(mode), Context())]

    results = await asyncio.gather(
        drain("raise_late"), *(drain("ok") for _ in range(3)), return_exceptions=True
    )
    assert isinstance(results[0], EngineError)
    assert all(r[-1]["finish_reason"] == "length" for r in results[1:])


async def test_a_stream_without_terminal_becomes_an_error() -> None:
    host, _ = await started()
    with pytest.raises(EngineError, match="without a terminal"):
        _ = [c async for c in host.generate(request("no_terminal"), Context())]
