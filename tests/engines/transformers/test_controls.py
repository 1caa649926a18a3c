"""RL controls and updates: pause modes, weight updates, versions, sleep, abort by id."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import greedy, run, tokens

HELD_S = 0.4


def test_advertised_names(engine: TransformersEngine) -> None:
    assert engine.supported_controls() == {
        "pause_generation",
        "resume_generation",
        "is_paused",
        "is_sleeping",
        "sleep",
        "wake_up",
        "get_weight_version",
        "flush_cache",
        "abort_request",
        "weights_checksum",
        "get_weights_by_name",
        "reset_weights",
    }
    assert engine.supported_updates() == {
        "update_weights_from_disk",
        "init_weights_update_group",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "update_weights_from_nixl",
        "destroy_weights_update_group",
        "update_weight_version",
        "set_weight_version",
        "receive_lora_adapter",
        "load_lora",
        "unload_lora",
    }


async def test_pause_abort_cancels_in_flight_and_holds_new_requests(
    engine: TransformersEngine,
) -> None:
    in_flight = engine.generate(greedy(max_tokens=400), Context("in-flight"))
    await anext(in_flight)
    reply = await engine.engine_control("pause_generation", {"mode": "abort"})
    assert reply == {"status": "paused", "mode": "abort", "aborted": ["in-flight"]}
    rest = [chunk async for chunk in in_flight]
    assert rest[-1]["finish_reason"] == "cancelled"
    assert await engine.engine_control("is_paused", {}) == {"is_paused": True}

    held = asyncio.create_task(run(engine, greedy(max_tokens=3)))
    await asyncio.sleep(HELD_S)
    assert not held.done()
    assert await engine.engine_control("resume_generation", {}) == {"status": "resumed"}
    assert (await held)[0].finish_reason == "length"


async def test_pause_wait_returns_after_in_flight_requests_finish(
    engine: TransformersEngine,
) -> None:
    in_flight = asyncio.create_task(run(engine, greedy(max_tokens=40)))
    await asyncio.sleep(0.05)
    await engine.engine_control("pause_generation", {"mode": "wait"})
    # Finished before the pause returned: only delivering the last chunk is left.
    assert (await asyncio.wait_for(in_flight, 1.0))[0].finish_reason == "length"

    held = asyncio.create_task(run(engine, greedy(max_tokens=3)))
    await asyncio.sleep(HELD_S)
    assert not held.done()
    await engine.engine_control("resume_generation", {})
    assert (await held)[0].finish_reason == "length"


async def test_pause_keep_freezes_and_resumes_where_it_stopped(
    engine: TransformersEngine,
) -> None:
    expected = await tokens(engine, greedy(max_tokens=60))
    received: list[int] = []
    first_token = asyncio.Event()

    async def consume() -> str:
        async for chunk in engine.generate(greedy(max_tokens=60), Context("kept")):
            received.extend(chunk["token_ids"])
            first_token.set()
            if "finish_reason" in chunk:
                return chunk["finish_reason"]
        return "no terminal"

    consumer = asyncio.create_task(consume())
    await first_token.wait()
    await engine.engine_control("pause_generation", {"mode": "keep"})
    await asyncio.sleep(0.05)
    frozen_at = len(received)
    await asyncio.sleep(HELD_S)
    assert len(received) == frozen_at < 60
    await engine.engine_control("resume_generation", {})
    assert await consumer == "length"
    assert received == expected


async def test_invalid_pause_mode_is_an_error(engine: TransformersEngine) -> None:
    reply = await engine.engine_control("pause_generation", {"mode": "later"})
    assert reply["status"] == "error"
    assert "later" in reply["message"]
    assert (await engine.engine_control("is_paused", {}))["is_paused"] is False


async def test_non_object_body_and_unknown_names(engine: TransformersEngine) -> None:
    assert (await engine.engine_control("pause_generation", ["abort"]))["message"] == (
        "request body must be a JSON object"
    )
    assert (await engine.engine_control("reboot", {}))["message"] == (
        "unsupported engine control: reboot"
    )
    assert (await engine.engine_update("reboot", {}))["message"] == (
        "unsupported engine update: reboot"
    )


async def test_weight_update_gives_the_new_weights_greedy_output(
    tiny_model_dir: Path, other_tiny_model_dir: Path
) -> None:
    reference = await start_engine(other_tiny_model_dir)
    try:
        wanted = await tokens(reference, greedy(max_tokens=20))
    finally:
        await reference.cleanup()
    engine = await start_engine(tiny_model_dir)
    try:
        before = await tokens(engine, greedy(max_tokens=20))
        assert before != wanted
        unpaused = await engine.engine_update(
            "update_weights_from_disk", {"model_path": str(other_tiny_model_dir)}
        )
        assert unpaused["status"] == "error"
        assert "pause" in unpaused["message"]

        await engine.engine_control("pause_generation", {"mode": "wait"})
        reply = await engine.engine_update(
            "update_weights_from_disk",
            {"model_path": str(other_tiny_model_dir), "weight_version": "v2"},
        )
        assert reply["status"] == "ok"
        assert (reply["version"], reply["version_declared"]) == ("v2", True)
        await engine.engine_control("resume_generation", {})
        choice = (await run(engine, greedy(max_tokens=20)))[0]
        assert choice.token_ids == wanted
        assert choice.chunks[0]["engine_data"] == {"weight_version": "v2"}
    finally:
        await engine.cleanup()


@pytest.mark.parametrize("bad", ["missing", "wider", "not-safetensors"])
async def test_failed_weight_update_keeps_the_old_weights(
    engine: TransformersEngine, wider_tiny_model_dir: Path, tmp_path: Path, bad: str
) -> None:
    before = await tokens(engine, greedy(max_tokens=20))
    path = {
        "missing": tmp_path / "nowhere",
        "wider": wider_tiny_model_dir,
        "not-safetensors": tmp_path,
    }[bad]
    await engine.engine_control("pause_generation", {})
    reply = await engine.engine_update("update_weights_from_disk", {"model_path": str(path)})
    await engine.engine_control("resume_generation", {})
    assert reply["status"] == "error"
    assert "previous weights keep serving" in reply["message"]
    if bad == "wider":
        assert "shapes do not match" in reply["message"]
    assert await tokens(engine, greedy(max_tokens=20)) == before
    assert (await engine.engine_control("get_weight_version", {}))["version"] is None


async def test_weight_versions(engine: TransformersEngine) -> None:
    assert await engine.engine_control("get_weight_version", {}) == {
        "status": "ok",
        "version": None,
        "version_declared": False,
        "weight_version": None,
    }
    assert await engine.engine_update("update_weight_version", {"new_version": "a"}) == {
        "status": "ok",
        "success": True,
        "new_version": "a",
    }
    assert await engine.engine_update("set_weight_version", {"weight_version": "b"}) == {
        "status": "ok",
        "version": "b",
    }
    assert (await engine.engine_control("get_weight_version", {}))["version"] == "b"
    missing = await engine.engine_update("set_weight_version", {})
    assert missing == {"status": "error", "message": "Missing 'weight_version' in body"}
    empty = await engine.engine_update("update_weight_version", {"new_version": ""})
    assert empty["status"] == "error"


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_holds_requests_and_wake_up_serves_them_unchanged(
    engine: TransformersEngine, level: int
) -> None:
    expected = await tokens(engine, greedy(max_tokens=12))
    reply = await engine.engine_control("sleep", {"level": level})
    assert reply["status"] == "sleeping"
    assert (await engine.engine_control("is_sleeping", {}))["is_sleeping"] is True
    if level == 2:
        assert engine.model is None, "level 2 drops the weights"

    held = asyncio.create_task(tokens(engine, greedy(max_tokens=12)))
    await asyncio.sleep(HELD_S)
    assert not held.done()
    partial = await engine.engine_control("wake_up", {"tags": ["kv_cache"]})
    assert partial["status"] == "partially_awake"
    assert partial["is_sleeping"] is True
    await asyncio.sleep(0.1)
    assert not held.done()
    reply = await engine.engine_control("wake_up", {"tags": ["weights"]})
    assert reply["status"] == "awake"
    assert await held == expected
    assert (await engine.engine_control("is_sleeping", {}))["is_sleeping"] is False


async def test_sleep_rejects_a_bad_level_and_wake_up_bad_tags(engine: TransformersEngine) -> None:
    assert (await engine.engine_control("sleep", {"level": 3}))["status"] == "error"
    assert (await engine.engine_control("wake_up", {"tags": ["gpu"]}))["status"] == "error"
    assert await engine.engine_control("wake_up", {}) == {"status": "awake", "is_sleeping": False}


async def test_abort_request_by_id(engine: TransformersEngine) -> None:
    stream = engine.generate(greedy(max_tokens=400), Context("rollout-17"))
    await anext(stream)
    reply = await engine.engine_control("abort_request", {"request_id": "rollout-17"})
    assert reply == {"status": "ok", "aborted": ["rollout-17"]}
    rest = [chunk async for chunk in stream]
    assert rest[-1]["finish_reason"] == "cancelled"
    missing = await engine.engine_control("abort_request", {})
    assert missing["status"] == "error"
    assert missing["message"].startswith("Missing 'request_id' in body")
    unknown = await engine.engine_control("abort_request", {"request_id": "nobody"})
    assert unknown == {"status": "ok", "aborted": []}


async def test_flush_cache(engine: TransformersEngine) -> None:
    assert await engine.engine_control("flush_cache", {}) == {
        "status": "ok",
        "message": "Cache flushed",
        "flushed_entries": None,
    }


async def test_a_snapshot_puts_back_the_weights_and_version_an_update_replaced(
    engine: TransformersEngine, other_tiny_model_dir: Path
) -> None:
    before = await tokens(engine, greedy(max_tokens=12))
    summed = await engine.engine_control("weights_checksum", {})
    await engine.engine_control("pause_generation", {"mode": "wait"})
    snapshot = await engine.weights_snapshot()
    reply = await engine.engine_update(
        "update_weights_from_disk",
        {"model_path": str(other_tiny_model_dir), "weight_version": "v9"},
    )
    assert reply["checksum"] != summed["checksum"]
    await engine.restore_weights_snapshot(snapshot)
    await engine.engine_control("resume_generation", {})
    assert (await engine.engine_control("weights_checksum", {}))["checksum"] == summed["checksum"]
    assert (await engine.engine_control("get_weight_version", {}))["weight_version"] is None
    assert await tokens(engine, greedy(max_tokens=12)) == before


async def test_abort_all_ends_every_request_in_flight_with_what_it_produced(
    engine: TransformersEngine,
) -> None:
    streams = [engine.generate(greedy(max_tokens=400), Context(f"r{i}")) for i in range(2)]
    firsts = [await anext(stream) for stream in streams]
    reply = await engine.engine_control("abort_request", {"abort_all": True})
    assert reply == {"status": "ok", "aborted": ["r0", "r1"]}
    for first, stream in zip(firsts, streams, strict=True):
        rest = [chunk async for chunk in stream]
        produced = len(first["token_ids"]) + sum(len(c["token_ids"]) for c in rest)
        assert rest[-1]["finish_reason"] == "cancelled"
        assert 1 <= rest[-1]["completion_usage"]["completion_tokens"] == produced < 400
    assert (await run(engine, greedy(max_tokens=3)))[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("sleep", "wakes"),
    [
        ({"level": 0}, [["kv_cache"]]),
        ({"level": 1, "tags": ["kv_cache"]}, [["kv_cache"]]),
        ({"level": 2, "tags": ["weights"]}, [["kv_cache"], ["weights"]]),
        ({"level": 1}, [["weights"], ["kv_cache"]]),
    ],
)
async def test_a_wake_of_every_released_tag_serves_again(
    engine: TransformersEngine, sleep: dict[str, object], wakes: list[list[str]]
) -> None:
    expected = await tokens(engine, greedy(max_tokens=8))
    assert (await engine.engine_control("sleep", sleep))["status"] == "sleeping"
    for tags in wakes:
        reply = await engine.engine_control("wake_up", {"tags": tags})
    assert reply == {"status": "awake", "is_sleeping": False}
    assert await asyncio.wait_for(tokens(engine, greedy(max_tokens=8)), 30) == expected


async def test_get_weights_by_name_answers_the_first_rows(engine: TransformersEngine) -> None:
    reply = await engine.engine_control(
        "get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 2}
    )
    rows = engine.model.model.embed_tokens.weight.detach()[:2].double()
    assert reply["shape"][1] == len(reply["values"][0]) == 64
    torch.testing.assert_close(torch.tensor(reply["values"], dtype=torch.float64), rows)
    bad = await engine.engine_control("get_weights_by_name", {"name": "nope"})
    assert bad["status"] == "error" and "nope" in bad["message"]


async def test_reset_weights_changes_every_tensor(engine: TransformersEngine) -> None:
    before = (await engine.engine_control("weights_checksum", {}))["tensors"]
    reply = await engine.engine_control("reset_weights", {})
    after = (await engine.engine_control("weights_checksum", {}))["tensors"]
    assert reply["status"] == "ok" and set(after) == set(before)
    assert all(after[name] != before[name] for name in before)
