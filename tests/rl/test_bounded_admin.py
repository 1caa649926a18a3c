"""No admin operation waits without bound: the admin timeout, and sleep over a keep pause."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from penstock.engines.context import Context
from penstock.engines.contract import GenerateChunk
from penstock.engines.samples.engine import (
    SAMPLE_TOKENIZER_DIR,
    SampleLLMEngine,
    write_sample_weights,
)
from penstock.errors import ConflictError
from penstock.rl.state import AdminStateMachine
from penstock.settings import DEFAULT_ADMIN_TIMEOUT_S, Settings
from tests.support.inprocess import asgi_client, start_gateway

# Generous: only reached when the code under test is wrong and something hangs.
HANG_S = 10.0
SHORT_TIMEOUT_S = 0.2


@pytest.fixture
async def engine() -> AsyncIterator[SampleLLMEngine]:
    started = SampleLLMEngine("m", tokenizer_dir=SAMPLE_TOKENIZER_DIR, delay=0.001)
    await started.start(0)
    yield started
    await started.cleanup()


class Request:
    """One generation whose chunks the test pulls itself: while it does not pull, the
    request stays in flight, so a drain waiting on it can never finish."""

    def __init__(self, engine: SampleLLMEngine, max_tokens: int) -> None:
        body: Any = {"token_ids": [1], "stop_conditions": {"max_tokens": max_tokens}}
        self.stream = engine.generate(body, Context())
        self.chunks: list[GenerateChunk] = []

    async def pull(self) -> None:
        self.chunks.append(await asyncio.wait_for(anext(self.stream), HANG_S))

    async def rest(self) -> list[GenerateChunk]:
        async def drain() -> None:
            async for chunk in self.stream:
                self.chunks.append(chunk)

        await asyncio.wait_for(drain(), HANG_S)
        return self.chunks

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1].get("finish_reason")


async def bounded(operation: Any) -> Any:
    return await asyncio.wait_for(operation, HANG_S)


async def test_sleep_over_a_keep_pause_leaves_frozen_requests_to_continue_after_resume(
    engine: SampleLLMEngine,
) -> None:
    machine = AdminStateMachine(engine)
    request = Request(engine, 5)
    await request.pull()
    await machine.pause("keep")
    frozen = asyncio.create_task(request.rest())
    # SGLang's release_memory_occupation sleeps in mode wait.
    await bounded(machine.sleep(1, "wait", None))
    assert machine.name == "sleeping" and machine.pause_mode == "keep"
    assert not frozen.done()
    await bounded(machine.wake_up(None))
    assert machine.name == "paused" and not frozen.done()
    await bounded(machine.resume())
    chunks = await frozen
    assert sum(len(chunk["token_ids"]) for chunk in chunks) == 5
    assert request.finish_reason == "length"


async def test_sleep_in_abort_mode_over_a_keep_pause_aborts_the_frozen_requests(
    engine: SampleLLMEngine,
) -> None:
    machine = AdminStateMachine(engine)
    request = Request(engine, 50)
    await request.pull()
    await machine.pause("keep")
    await bounded(machine.sleep(1, "abort", None))
    await request.rest()
    assert request.finish_reason == "abort"
    await bounded(machine.wake_up(None))
    await bounded(machine.resume())
    assert machine.name == "serving"


@pytest.mark.parametrize("operation", ["pause", "sleep"])
async def test_a_wait_that_overruns_is_409_and_undone(
    engine: SampleLLMEngine, operation: str
) -> None:
    machine = AdminStateMachine(engine, timeout_s=SHORT_TIMEOUT_S)
    request = Request(engine, 3)
    await request.pull()
    call = machine.pause("wait") if operation == "pause" else machine.sleep(1, "wait", None)
    with pytest.raises(ConflictError) as raised:
        await bounded(call)
    error = raised.value
    assert error.code == "admin_timeout" and error.extra["state"] == "serving"
    assert "use mode abort or keep" in error.message
    assert machine.name == "serving"
    paused = await engine.engine_control("is_paused", {})
    sleeping = await engine.engine_control("is_sleeping", {})
    assert paused["is_paused"] is False and sleeping["is_sleeping"] is False
    await request.rest()
    assert request.finish_reason == "length"
    later = Request(engine, 2)
    await later.rest()
    assert later.finish_reason == "length"


async def test_an_operation_that_cannot_get_the_lock_in_time_is_409_busy(
    engine: SampleLLMEngine,
) -> None:
    # The holder's deadline is set when it starts: a longer one than the waiter's keeps
    # the lock held past the moment the waiter gives up.
    machine = AdminStateMachine(engine, timeout_s=5 * SHORT_TIMEOUT_S)
    stuck = asyncio.Event()
    original = engine.engine_control

    async def hanging(control: str, body: dict[str, Any]) -> dict[str, Any]:
        if control == "flush_cache":
            stuck.set()
            await asyncio.Event().wait()
        return await original(control, body)

    engine.engine_control = hanging  # type: ignore[method-assign]
    flush = asyncio.create_task(machine.run_control("flush_cache", {}))
    await bounded(stuck.wait())
    machine.timeout_s = SHORT_TIMEOUT_S
    with pytest.raises(ConflictError) as busy:
        await bounded(machine.pause("abort"))
    assert busy.value.code == "admin_busy" and "'flush_cache'" in busy.value.message
    assert busy.value.extra["state"] == "serving"
    with pytest.raises(ConflictError) as overran:
        await bounded(flush)
    assert overran.value.code == "admin_timeout"
    assert (await bounded(machine.pause("abort"))).changed
    assert machine.name == "paused"


async def test_a_weight_update_that_overruns_is_409_paused_and_publishes_nothing(
    engine: SampleLLMEngine, tmp_path: Path
) -> None:
    machine = AdminStateMachine(engine, timeout_s=SHORT_TIMEOUT_S)

    async def hanging(update: str, body: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.get_running_loop().create_future()

    engine.engine_update = hanging  # type: ignore[method-assign]
    await machine.pause("keep")
    write_sample_weights(tmp_path, 4)
    with pytest.raises(ConflictError) as raised:
        await bounded(
            machine.update_weights("update_weights_from_disk", {"model_path": str(tmp_path)}, "v2")
        )
    assert raised.value.code == "admin_timeout" and raised.value.extra["state"] == "paused"
    assert machine.name == "paused" and machine.weight_version is None
    assert engine.weights.token_shift == 0


def test_the_admin_timeout_setting_has_a_default_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().admin_timeout_s == DEFAULT_ADMIN_TIMEOUT_S == 30.0
    monkeypatch.setenv("PENSTOCK_ADMIN_TIMEOUT_S", "4.5")
    assert Settings().admin_timeout_s == 4.5


async def test_the_gateway_gives_the_state_machine_its_admin_timeout() -> None:
    gateway = await start_gateway(admin_timeout_s=7.0)
    try:
        async for _ in asgi_client(gateway):
            assert gateway.admin.timeout_s == 7.0
    finally:
        await gateway.host.cleanup()
