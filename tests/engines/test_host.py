"""The engine host's guarantees, one test each."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from penstock.engines.context import Context
from penstock.engines.contract import MULTI_CHOICE_RUNTIME_KEY, EngineConfig, WorkerConfig
from penstock.engines.health import HEALTH_CHECK_KEY, EngineHealthMonitorConfig
from penstock.engines.host import EngineHost, EngineState
from penstock.errors import EngineError, InvalidRequestError
from tests.support.doubles import CancelSafeScriptedEngine, ScriptedEngine


def make_host(engine: ScriptedEngine | None = None, **kwargs: Any) -> EngineHost:
    return EngineHost(engine or ScriptedEngine(), WorkerConfig(namespace="test"), **kwargs)


# The guarantees that hold whether the engine runs in a task of its own or, cancel-safe,
# in its consumer's (see test_host_cancel_safe.py for what differs).
EITHER_KIND = pytest.mark.parametrize(
    "kind", [ScriptedEngine, CancelSafeScriptedEngine], ids=["own task", "cancel-safe"]
)


def request(mode: str = "ok") -> dict[str, Any]:
    return {"token_ids": [1, 2], "extra_args": {"mode": mode}}


async def drain(host: EngineHost, mode: str = "ok", context: Context | None = None) -> list[dict]:
    return [c async for c in host.generate(request(mode), context or Context())]


async def test_start_passes_an_opaque_stable_unique_worker_id() -> None:
    first, second = make_host(), make_host()
    await first.start()
    await second.start()
    assert first.engine.calls == [f"start:{first.worker_id}"]
    assert isinstance(first.worker_id, int)
    assert first.worker_id != second.worker_id
    worker_id = first.worker_id
    await drain(first)
    assert first.worker_id == worker_id
    assert first.state is EngineState.RUNNING


async def test_cleanup_runs_once_after_a_successful_start() -> None:
    host = make_host()
    await host.start()
    await host.cleanup()
    await host.cleanup()
    assert host.engine.calls.count("cleanup") == 1
    assert host.state is EngineState.STOPPED


async def test_failed_start_cleans_up_the_partial_state_and_reraises() -> None:
    engine = ScriptedEngine(fail_start=True)
    host = make_host(engine)
    with pytest.raises(RuntimeError, match="weights not found"):
        await host.start()
    assert engine.calls[-1] == "cleanup"
    assert engine.partial_resource is None
    await host.cleanup()
    assert engine.calls.count("cleanup") == 1


async def test_cleanup_is_not_called_when_start_never_ran() -> None:
    host = make_host()
    await host.cleanup()
    assert host.engine.calls == []


async def test_cleanup_waits_for_a_start_in_progress() -> None:
    engine = ScriptedEngine(start_delay=0.2)
    host = make_host(engine)
    starting = asyncio.create_task(host.start())
    await asyncio.sleep(0.05)
    await host.cleanup()
    await starting
    assert [c.split(":")[0] for c in engine.calls] == ["start", "cleanup"]


@EITHER_KIND
async def test_natural_completion_never_aborts(kind: type[ScriptedEngine]) -> None:
    host = make_host(kind())
    await host.start()
    chunks = await drain(host)
    await asyncio.sleep(0.05)
    assert chunks[-1]["finish_reason"] == "length"
    assert host.engine.aborted == []


@EITHER_KIND
async def test_consumer_going_away_aborts_exactly_once(kind: type[ScriptedEngine]) -> None:
    host = make_host(kind())
    await host.start()
    context = Context("gone")
    stream = host.generate(request("slow"), context)
    await anext(stream)
    await stream.aclose()
    host.cancel(context)
    await asyncio.sleep(0.05)
    assert host.engine.aborted == ["gone"]
    assert context.is_killed()


@EITHER_KIND
async def test_cancel_stops_the_request_and_aborts_once(kind: type[ScriptedEngine]) -> None:
    host = make_host(kind())
    await host.start()
    context = Context("cancelled")
    chunks = []
    async for chunk in host.generate(request("slow"), context):
        chunks.append(chunk)
        if len(chunks) == 3:
            host.cancel(context)
            host.cancel(context)
    await asyncio.sleep(0.05)
    assert chunks[-1]["finish_reason"] == "cancelled"
    assert host.engine.aborted == ["cancelled"]


async def cancel_a_consuming_task(host: EngineHost, context: Context) -> None:
    """Start a task reading a slow stream, and cancel it mid-way."""

    async def consume() -> None:
        async for _ in host.generate(request("slow"), context):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@EITHER_KIND
async def test_cancelled_task_aborts_within_100ms(kind: type[ScriptedEngine]) -> None:
    host = make_host(kind())
    await host.start()
    context = Context("task")
    await cancel_a_consuming_task(host, context)
    await asyncio.sleep(0.1)
    assert host.engine.aborted == ["task"]


@EITHER_KIND
async def test_an_exception_in_generate_is_one_error_and_others_keep_running(
    kind: type[ScriptedEngine],
) -> None:
    host = make_host(kind())
    await host.start()
    failing = drain(host, "raise_late")
    healthy = [drain(host) for _ in range(3)]
    results = await asyncio.gather(failing, *healthy, return_exceptions=True)
    assert isinstance(results[0], EngineError)
    assert "secret" not in results[0].message and "device" not in results[0].message
    assert all(r[-1]["finish_reason"] == "length" for r in results[1:])


@EITHER_KIND
async def test_value_errors_keep_their_message_as_a_client_error(
    kind: type[ScriptedEngine],
) -> None:
    host = make_host(kind())
    await host.start()
    with pytest.raises(InvalidRequestError, match="temperature must be positive"):
        await drain(host, "raise_value")


async def test_a_chunk_after_the_terminal_is_dropped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = make_host()
    await host.start()
    with caplog.at_level(logging.ERROR):
        chunks = await drain(host, "after_terminal")
        await asyncio.sleep(0.05)
    assert [c["token_ids"] for c in chunks] == [[5], [7]]
    assert caplog.text.count("contract violation") == 1


@EITHER_KIND
async def test_a_stream_without_terminal_becomes_an_error(kind: type[ScriptedEngine]) -> None:
    host = make_host(kind())
    await host.start()
    with pytest.raises(EngineError, match="without a terminal"):
        await drain(host, "no_terminal")


class MultiChoiceScriptedEngine(ScriptedEngine):
    """Advertises that it yields ``n`` choices itself (so the host does not fan out)."""

    async def start(self, worker_id: int) -> EngineConfig:
        config = await super().start(worker_id)
        config.runtime_data = {MULTI_CHOICE_RUNTIME_KEY: True}
        return config


async def test_n_choices_each_need_their_own_terminal() -> None:
    host = make_host(MultiChoiceScriptedEngine())
    await host.start()
    chunks = [
        c async for c in host.generate({"token_ids": [1], "sampling_options": {"n": 1}}, Context())
    ]
    assert chunks[-1]["finish_reason"] == "length"
    with pytest.raises(EngineError):
        await anext_all(host.generate({"token_ids": [1], "sampling_options": {"n": 2}}, Context()))


async def anext_all(stream: Any) -> list[dict]:
    return [c async for c in stream]


async def test_health_canary_carries_the_marker_and_marks_healthy() -> None:
    engine = ScriptedEngine()
    engine.canary = {"token_ids": [1], "stop_conditions": {"max_tokens": 1}}
    host = make_host(engine)
    await host.start()
    status = await host.check_health()
    assert status.healthy
    assert engine.requests[-1][HEALTH_CHECK_KEY] is True
    assert engine.requests[-1]["token_ids"] == [1]


async def test_operator_canary_replaces_the_engine_payload_whole() -> None:
    engine = ScriptedEngine()
    engine.canary = {"token_ids": [1], "stop_conditions": {"max_tokens": 1}}
    host = make_host(engine, health_check_override={"token_ids": [9]})
    await host.start()
    await host.check_health()
    assert engine.requests[-1] == {"token_ids": [9], HEALTH_CHECK_KEY: True}


async def test_failing_canary_turns_unhealthy_with_the_reason() -> None:
    engine = ScriptedEngine()
    engine.canary = request("raise_first")
    host = make_host(engine)
    await host.start()
    status = await host.check_health()
    assert not status.healthy
    assert "health canary failed" in (status.reason or "")


async def test_hung_canary_times_out_and_turns_unhealthy() -> None:
    engine = ScriptedEngine()
    engine.canary = request("hang")
    monitor = EngineHealthMonitorConfig(interval=0.05, check_timeout=0.2, shutdown_timeout=1)
    host = make_host(engine, monitor=monitor)
    await host.start()
    status = await host.check_health()
    assert not status.healthy
    assert "timed out after 0.2s" in (status.reason or "")


async def test_monitor_probes_when_idle_and_never_while_busy() -> None:
    engine = ScriptedEngine()
    engine.canary = {"token_ids": [1]}
    monitor = EngineHealthMonitorConfig(interval=0.05, check_timeout=1, shutdown_timeout=1)
    host = make_host(engine, monitor=monitor)
    await host.start()

    def probes() -> int:
        return len([r for r in engine.requests if r.get(HEALTH_CHECK_KEY)])

    host.start_monitor()
    async with asyncio.timeout(10):
        while probes() < 2:  # noqa: ASYNC110 - the engine double has no event to wait on
            await asyncio.sleep(0.01)
    busy = host.generate(request("slow"), Context("busy"))
    await anext(busy)
    before = probes()
    await asyncio.sleep(0.3)
    assert probes() == before
    await busy.aclose()
    await host.stop_monitor()
    assert host.health.healthy


def test_monitor_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_INTERVAL", "0.5")
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_TIMEOUT", "nonsense")
    monkeypatch.setenv("DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT", "-3")
    config = EngineHealthMonitorConfig.from_env(interval=None, check_timeout=None)
    assert config == EngineHealthMonitorConfig(0.5, 30.0, 0.0)
    assert EngineHealthMonitorConfig.from_env(interval=7).interval == 7
