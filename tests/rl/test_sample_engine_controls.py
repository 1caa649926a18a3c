"""The sample engine's simulated RL controls, observed through ``generate``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from penstock.engines.context import Context
from penstock.engines.samples.engine import (
    SAMPLE_TOKENIZER_DIR,
    SampleLLMEngine,
    write_sample_weights,
)


@pytest.fixture
async def engine() -> AsyncIterator[SampleLLMEngine]:
    started = SampleLLMEngine("m", tokenizer_dir=SAMPLE_TOKENIZER_DIR, delay=0.005)
    await started.start(0)
    yield started
    await started.cleanup()


async def run(
    engine: SampleLLMEngine, context: Context, max_tokens: int = 10, **extra: Any
) -> list[dict[str, Any]]:
    request: Any = {"token_ids": [1, 2], "stop_conditions": {"max_tokens": max_tokens}, **extra}
    return [chunk async for chunk in engine.generate(request, context)]


async def control(engine: SampleLLMEngine, name: str, **body: Any) -> dict[str, Any]:
    return await engine.engine_control(name, body)


async def test_every_chunk_carries_the_weight_version(engine: SampleLLMEngine) -> None:
    await engine.engine_update("update_weight_version", {"new_version": "v7"})
    chunks = await run(engine, Context(), 3)
    assert [c["engine_data"] for c in chunks] == [{"weight_version": "v7"}] * 3


async def test_abort_mode_ends_in_flight_requests_at_once(engine: SampleLLMEngine) -> None:
    task = asyncio.create_task(run(engine, Context("r1"), 200))
    await asyncio.sleep(0.02)
    paused = await control(engine, "pause_generation", mode="abort")
    assert paused == {"status": "paused", "mode": "abort", "aborted": ["r1"]}
    chunks = await asyncio.wait_for(task, 5)
    assert chunks[-1]["finish_reason"] == "abort" and len(chunks) < 200


async def test_requests_arriving_while_paused_wait_and_run_after_resume(
    engine: SampleLLMEngine,
) -> None:
    await control(engine, "pause_generation", mode="abort")
    late = asyncio.create_task(run(engine, Context("late"), 3))
    await asyncio.sleep(0.05)
    assert not late.done()
    await control(engine, "resume_generation")
    chunks = await asyncio.wait_for(late, 5)
    assert chunks[-1]["finish_reason"] == "length" and len(chunks) == 3


async def test_keep_mode_freezes_and_a_cancel_still_ends_the_request(
    engine: SampleLLMEngine,
) -> None:
    context = Context("frozen")
    task = asyncio.create_task(run(engine, context, 200))
    await asyncio.sleep(0.02)
    await control(engine, "pause_generation", mode="keep")
    await asyncio.sleep(0.05)
    assert not task.done()
    context.stop_generating()
    chunks = await asyncio.wait_for(task, 5)
    assert chunks[-1]["finish_reason"] == "cancelled"


async def test_abort_request_by_id_ends_only_that_request(engine: SampleLLMEngine) -> None:
    keep = asyncio.create_task(run(engine, Context("keep"), 20))
    drop = asyncio.create_task(run(engine, Context("drop"), 200))
    await asyncio.sleep(0.02)
    assert await control(engine, "abort_request", request_id="drop") == {
        "status": "ok",
        "aborted": ["drop"],
    }
    assert (await drop)[-1]["finish_reason"] == "abort"
    assert (await keep)[-1]["finish_reason"] == "length"


async def test_sleep_holds_new_requests_until_every_tag_is_awake(
    engine: SampleLLMEngine,
) -> None:
    slept = await control(engine, "sleep", level=1)
    assert slept["tags"] == ["kv_cache", "weights"]
    task = asyncio.create_task(run(engine, Context(), 2))
    await control(engine, "wake_up", tags=["weights"])
    await asyncio.sleep(0.03)
    assert not task.done()
    assert (await control(engine, "is_sleeping")) == {"is_sleeping": True, "tags": ["kv_cache"]}
    await control(engine, "wake_up", tags=["kv_cache"])
    assert len(await asyncio.wait_for(task, 5)) == 2


async def test_health_probes_pass_a_pause(engine: SampleLLMEngine) -> None:
    await control(engine, "pause_generation", mode="keep")
    probe = await asyncio.wait_for(run(engine, Context(), 1, _HEALTH_CHECK=True), 2)
    assert probe[-1]["finish_reason"] == "length"


async def test_weights_shift_the_tokens_and_bad_files_keep_the_old_ones(
    engine: SampleLLMEngine, tmp_path: Path
) -> None:
    refused = await engine.engine_update("update_weights_from_disk", {"model_path": "/x"})
    assert refused["status"] == "error" and "pause generation" in refused["message"]
    await control(engine, "pause_generation", mode="wait")
    good = write_sample_weights(tmp_path / "good.safetensors", 11)
    assert (await engine.engine_update("update_weights_from_disk", {"model_path": str(good)}))[
        "status"
    ] == "ok"
    bad_files = {
        "shape": {"token_shift": np.array([1, 2], dtype=np.int64)},
        "missing": {"other": np.array([1], dtype=np.int64)},
        "dtype": {"token_shift": np.array([1.5], dtype=np.float32)},
    }
    for name, tensors in bad_files.items():
        path = tmp_path / f"{name}.safetensors"
        safetensors.numpy.save_file(tensors, path)
        result = await engine.engine_update("update_weights_from_disk", {"model_path": str(path)})
        assert result["status"] == "error", name
    (tmp_path / "garbage.safetensors").write_bytes(b"not safetensors")
    garbage = str(tmp_path / "garbage.safetensors")
    result = await engine.engine_update("update_weights_from_disk", {"model_path": garbage})
    assert result["status"] == "error"
    await control(engine, "resume_generation")
    tokens = [c["token_ids"][0] for c in await run(engine, Context(), 3)]
    assert tokens == [engine.token_at(step, 0, 11) for step in range(3)]


async def test_bad_control_bodies_are_error_responses(engine: SampleLLMEngine) -> None:
    for name, body in [
        ("pause_generation", {"mode": "retract"}),
        ("pause_generation", {"clear_cache": "no"}),
        ("sleep", {"level": 3}),
        ("wake_up", {"tags": ["gpu"]}),
        ("abort_request", {}),
    ]:
        result = await engine.engine_control(name, body)
        assert result["status"] == "error" and result["message"], name
    unknown = await engine.engine_control("nope", {})
    assert unknown == {"status": "error", "message": "unsupported engine control: nope"}
