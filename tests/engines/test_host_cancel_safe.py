"""A cancel-safe engine runs in its consumer's task: how a consumer going away reaches it
(the guarantees it shares with every engine are in test_host.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import pytest

from penstock.engines.context import Context
from penstock.engines.contract import (
    GenerateChunk,
    GenerateRequest,
    WorkerConfig,
)
from penstock.engines.host import EngineHost
from tests.engines.test_host import cancel_a_consuming_task, request
from tests.support.doubles import CancelSafeScriptedEngine


class CancelSafeEngine(CancelSafeScriptedEngine):
    """Records how each stream ended, and in which task it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.endings: dict[str, str] = {}
        self.tasks: dict[str, asyncio.Task[Any] | None] = {}

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


async def test_the_engine_runs_in_the_consumers_task_and_is_closed_after_its_terminal() -> None:
    host, engine = await started()
    chunks = [c async for c in host.generate(request(), Context("done"))]
    await asyncio.sleep(0.05)
    assert engine.tasks["done"] is asyncio.current_task()
    assert [c["token_ids"] for c in chunks] == [[5], [7]]
    assert chunks[-1]["finish_reason"] == "length"
    assert engine.endings["done"] == "closed at a yield"
    assert engine.aborted == []


async def _close_the_stream(host: EngineHost, context: Context) -> None:
    stream = host.generate(request("slow"), context)
    await anext(stream)
    await stream.aclose()


@pytest.mark.parametrize(
    ("leave", "ending"),
    [(_close_the_stream, "closed at a yield"), (cancel_a_consuming_task, "cancelled at an await")],
    ids=["stream closed", "task cancelled"],
)
async def test_a_consumer_going_away_reaches_the_engine_at_once(
    leave: Callable[[EngineHost, Context], Awaitable[None]], ending: str
) -> None:
    host, engine = await started()
    context = Context("gone")
    await leave(host, context)
    # No loop turn in between: the engine's stream has already ended, in this task.
    assert engine.endings["gone"] == ending
    await asyncio.sleep(0.05)
    assert engine.aborted == ["gone"]
