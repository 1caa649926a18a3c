"""The admin state machine over a real (sample) engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from penstock.engines.context import Context
from penstock.engines.samples.engine import (
    SAMPLE_TOKENIZER_DIR,
    SampleLLMEngine,
    write_sample_weights,
)
from penstock.errors import ConflictError, InvalidRequestError, ServiceUnavailableError
from penstock.rl.state import AdminStateMachine


class Published:
    def __init__(self) -> None:
        self.versions: list[str | None] = []
        self.draining = False


@pytest.fixture
async def engine() -> AsyncIterator[SampleLLMEngine]:
    started = SampleLLMEngine("m", tokenizer_dir=SAMPLE_TOKENIZER_DIR, delay=0.005)
    await started.start(0)
    yield started
    await started.cleanup()


@pytest.fixture
def published() -> Published:
    return Published()


@pytest.fixture
def machine(engine: SampleLLMEngine, published: Published) -> AdminStateMachine:
    return AdminStateMachine(
        engine, is_draining=lambda: published.draining, publish_version=published.versions.append
    )


async def tokens(engine: SampleLLMEngine, max_tokens: int = 3) -> list[int]:
    request: Any = {"token_ids": [1], "stop_conditions": {"max_tokens": max_tokens}}
    return [
        t
        for chunk in [c async for c in engine.generate(request, Context())]
        for t in chunk["token_ids"]
    ]


async def test_pause_and_resume_move_between_serving_and_paused(
    machine: AdminStateMachine,
) -> None:
    assert machine.name == "serving"
    outcome = await machine.pause("keep")
    assert outcome.changed and machine.name == "paused" and machine.pause_mode == "keep"
    assert machine.describe()["mode"] == "keep"
    resumed = await machine.resume()
    assert resumed.changed and machine.name == "serving"


async def test_repeating_an_operation_is_a_no_op(machine: AdminStateMachine) -> None:
    assert not (await machine.resume()).changed
    await machine.pause("wait")
    assert not (await machine.pause("wait")).changed
    assert machine.name == "paused"
    await machine.resume()
    assert not (await machine.wake_up(None)).changed
    await machine.sleep(1, "abort", None)
    assert not (await machine.sleep(1, "abort", ["weights"])).changed
    await machine.set_weight_version("v1")
    assert not (await machine.set_weight_version("v1")).changed


async def test_invalid_transitions_are_conflicts_carrying_the_state(
    machine: AdminStateMachine,
) -> None:
    await machine.pause("keep")
    with pytest.raises(ConflictError) as raised:
        await machine.pause("abort")
    assert raised.value.status_code == 409
    assert raised.value.extra["state"] == "paused"
    assert raised.value.extra["admin"]["mode"] == "keep"
    await machine.resume()
    await machine.sleep(1, "abort", None)
    for operation in (machine.pause("keep"), machine.resume()):
        with pytest.raises(ConflictError) as raised:
            await operation
        assert raised.value.extra["state"] == "sleeping"


async def test_weight_updates_need_the_paused_state(
    machine: AdminStateMachine, tmp_path: Path
) -> None:
    write_sample_weights(tmp_path, 7)
    with pytest.raises(ConflictError, match="pause generation before updating weights"):
        await machine.update_weights(
            "update_weights_from_disk", {"model_path": str(tmp_path)}, None
        )
    await machine.sleep(1, "abort", None)
    with pytest.raises(ConflictError, match="sleeping"):
        await machine.update_weights(
            "update_weights_from_disk", {"model_path": str(tmp_path)}, None
        )


async def test_an_update_between_steps_freezes_running_requests_and_continues_them(
    machine: AdminStateMachine, engine: SampleLLMEngine, tmp_path: Path
) -> None:
    write_sample_weights(tmp_path, 5)
    running = asyncio.create_task(tokens(engine, max_tokens=60))
    await asyncio.sleep(0.05)
    update = {"model_path": str(tmp_path)}
    await machine.update_weights("update_weights_from_disk", update, "v5", between_steps=True)
    assert not running.done()
    assert machine.name == "serving"
    assert (await engine.engine_control("is_paused", {}))["is_paused"] is False
    assert machine.describe()["last_update"]["applied"] == "between_steps"
    assert len(await running) == 60
    assert await tokens(engine) == [engine.token_at(step, 0, 5) for step in range(3)]


async def test_an_update_between_steps_writes_awake_weights_of_a_sleeping_engine(
    machine: AdminStateMachine, tmp_path: Path
) -> None:
    write_sample_weights(tmp_path, 4)
    update = {"model_path": str(tmp_path)}
    await machine.sleep(1, "abort", ["kv_cache", "weights"])
    with pytest.raises(ConflictError, match="sleeping"):
        await machine.update_weights("update_weights_from_disk", update, None, between_steps=True)
    await machine.wake_up(["weights"])
    await machine.update_weights("update_weights_from_disk", update, "v4", between_steps=True)
    assert machine.name == "sleeping" and machine.weight_version == "v4"
    assert machine.describe()["last_update"]["applied"] == "kv_released"


async def test_update_publishes_the_version_and_swaps_the_weights(
    machine: AdminStateMachine, engine: SampleLLMEngine, published: Published, tmp_path: Path
) -> None:
    before = await tokens(engine)
    write_sample_weights(tmp_path, 5)
    await machine.pause("wait")
    await machine.update_weights(
        "update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "v2"}, "v2"
    )
    assert machine.name == "paused"
    assert machine.weight_version == "v2" and machine.version_declared
    assert published.versions == ["v2"]
    await machine.resume()
    after = await tokens(engine)
    assert after == [engine.token_at(step, 0, 5) for step in range(3)] != before


async def test_a_failed_update_keeps_the_previous_state_weights_and_version(
    machine: AdminStateMachine, engine: SampleLLMEngine, published: Published, tmp_path: Path
) -> None:
    await machine.set_weight_version("v1")
    await machine.pause("keep")
    with pytest.raises(InvalidRequestError) as raised:
        await machine.update_weights(
            "update_weights_from_disk",
            {"model_path": str(tmp_path / "missing"), "weight_version": "v2"},
            "v2",
            param="model_path",
        )
    assert raised.value.param == "model_path"
    assert machine.name == "paused" and machine.pause_mode == "keep"
    assert machine.weight_version == "v1" and published.versions == ["v1"]
    assert engine.weights.token_shift == 0 and engine.weight_version == "v1"


async def test_a_failed_pause_restores_serving(machine: AdminStateMachine) -> None:
    class Refusing(SampleLLMEngine):
        async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
            return {"status": "error", "message": "busy"}

    machine.engine = Refusing("m", tokenizer_dir=SAMPLE_TOKENIZER_DIR)
    with pytest.raises(InvalidRequestError, match="busy"):
        await machine.pause("abort")
    assert machine.name == "serving"


async def test_state_is_updating_while_an_update_runs(
    machine: AdminStateMachine, engine: SampleLLMEngine, tmp_path: Path
) -> None:
    seen: list[dict[str, Any]] = []
    original = engine.engine_update

    async def observing(update: str, body: dict[str, Any]) -> dict[str, Any]:
        seen.append(machine.describe())
        return await original(update, body)

    engine.engine_update = observing  # type: ignore[method-assign]
    write_sample_weights(tmp_path, 1)
    await machine.pause("keep")
    await machine.update_weights("update_weights_from_disk", {"model_path": str(tmp_path)}, "v9")
    assert seen[0]["state"] == "updating" and seen[0]["target_version"] == "v9"
    assert machine.name == "paused"


async def test_sleep_and_partial_wake_return_to_the_state_sleep_started_from(
    machine: AdminStateMachine,
) -> None:
    await machine.pause("keep")
    await machine.sleep(1, "abort", None)
    assert machine.name == "sleeping" and machine.describe()["tags"] == ["kv_cache", "weights"]
    await machine.wake_up(["weights"])
    assert machine.name == "sleeping" and machine.describe()["tags"] == ["kv_cache"]
    await machine.wake_up(["kv_cache"])
    assert machine.name == "paused"
    await machine.resume()
    await machine.sleep(0, "abort", None)
    assert machine.describe()["tags"] == ["kv_cache"] and machine.sleep_level == 0
    await machine.wake_up(None)
    assert machine.name == "serving"


async def test_operations_are_serialized(
    machine: AdminStateMachine, engine: SampleLLMEngine
) -> None:
    running = asyncio.create_task(tokens(engine, 20))
    await asyncio.sleep(0)  # the request starts generating
    # A wait-mode pause holds the lock until in-flight work drains; the resume queued
    # behind it must run after it, never interleave.
    order: list[str] = []

    async def pause() -> None:
        await machine.pause("wait")
        order.append(f"paused, request done={running.done()}")

    async def resume() -> None:
        await asyncio.sleep(0)
        await machine.resume()
        order.append("resumed")

    await asyncio.gather(pause(), resume())
    assert order == ["paused, request done=True", "resumed"]
    assert machine.name == "serving" and len(await running) == 20


async def test_describe_is_json_and_draining_wins(
    machine: AdminStateMachine, published: Published
) -> None:
    await machine.pause("abort")
    described = json.loads(json.dumps(machine.describe()))
    assert set(described) == {
        "state",
        "mode",
        "tags",
        "sleep_level",
        "updating",
        "target_version",
        "last_update",
        "weight_version",
        "version_declared",
        "since",
    }
    published.draining = True
    assert machine.name == "draining"
    with pytest.raises(ServiceUnavailableError):
        await machine.resume()


async def test_unsupported_engine_controls_are_a_clear_400(machine: AdminStateMachine) -> None:
    with pytest.raises(
        InvalidRequestError, match="does not support the update 'update_weights_from_distributed'"
    ):
        await machine.pause("keep")
        await machine.update_weights("update_weights_from_distributed", {}, None)
    assert machine.name == "paused"
