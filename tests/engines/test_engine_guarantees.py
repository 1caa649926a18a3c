"""What the host guarantees engines written for Dynamo rely on, shown with contract-only
engines (no Dynamo import): optional methods, cancellation order, the decode-role abort
rule, ``n`` by fan-out and typed errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from penstock.engines.constants import DisaggregationMode
from penstock.engines.context import Context
from penstock.engines.contract import EngineConfig, LLMEngine, WorkerConfig
from penstock.engines.host import EngineHost
from penstock.errors import PenstockError
from penstock.settings import Settings
from tests.engines.test_model_input import dynamo_base
from tests.support.inprocess import asgi_client


class RecordingEngine(LLMEngine):
    """Counts tokens out, checking its context between yields; records what it saw."""

    def __init__(self, tokens: int = 50, delay: float = 0.01, first_delay: float = 0.0) -> None:
        self.tokens = tokens
        self.delay = delay
        self.first_delay = first_delay
        self.events: list[str] = []
        self.requests: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[RecordingEngine, WorkerConfig]:
        return cls(), WorkerConfig(namespace="test")

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="recording")

    async def cleanup(self) -> None:
        pass

    async def abort(self, context: Context) -> None:
        self.events.append(f"abort:{context.id()}")

    async def generate(
        self, request: dict[str, Any], context: Context
    ) -> AsyncGenerator[dict[str, Any], None]:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        try:
            await asyncio.sleep(self.first_delay)
            for i in range(self.tokens):
                if context.is_stopped():
                    killed = "killed" if context.is_killed() else "stopped"
                    self.events.append(f"saw-{killed}:{context.id()}")
                    yield {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
                    self.events.append(f"ended:{context.id()}")
                    return
                await asyncio.sleep(self.delay)
                last = i == self.tokens - 1
                yield {
                    "token_ids": [i + 1],
                    "index": 0,
                    **({"finish_reason": "length"} if last else {}),
                }
        except asyncio.CancelledError:
            self.events.append(f"cancelled-error:{context.id()}")
            raise


def host_for(engine: Any, mode: DisaggregationMode = DisaggregationMode.AGGREGATED) -> EngineHost:
    return EngineHost(engine, WorkerConfig(namespace="test", disaggregation_mode=mode))


async def consume(host: EngineHost, request: dict[str, Any], context: Context) -> list[dict]:
    return [chunk async for chunk in host.generate(request, context)]


async def test_a_client_going_away_marks_the_context_before_the_engine_ends_then_aborts_once() -> (
    None
):
    engine = RecordingEngine()
    host = host_for(engine)
    await host.start()
    context = Context("gone")
    task = asyncio.create_task(consume(host, {"token_ids": [1]}, context))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.1)
    assert context.is_killed()
    assert engine.events == ["saw-killed:gone", "ended:gone", "abort:gone"]


async def test_a_natural_completion_is_neither_killed_nor_aborted() -> None:
    engine = RecordingEngine(tokens=3)
    host = host_for(engine)
    await host.start()
    context = Context("done")
    chunks = await consume(host, {"token_ids": [1]}, context)
    await asyncio.sleep(0.05)
    assert chunks[-1]["finish_reason"] == "length"
    assert not context.is_stopped() and not context.is_killed()
    assert engine.events == []


async def test_cancel_lets_the_engine_finish_cancelled_then_aborts_once() -> None:
    engine = RecordingEngine()
    host = host_for(engine)
    await host.start()
    context = Context("stop")
    chunks = []
    async for chunk in host.generate({"token_ids": [1]}, context):
        chunks.append(chunk)
        if len(chunks) == 2:
            host.cancel(context)
            host.cancel(context)
    await asyncio.sleep(0.05)
    assert chunks[-1]["finish_reason"] == "cancelled"
    assert engine.events == ["saw-stopped:stop", "ended:stop", "abort:stop"]


async def test_decode_role_skips_the_abort_when_cancelled_before_the_first_token() -> None:
    engine = RecordingEngine(first_delay=0.1)
    host = host_for(engine, DisaggregationMode.DECODE)
    await host.start()
    context = Context("early")
    task = asyncio.create_task(consume(host, {"token_ids": [1]}, context))
    await asyncio.sleep(0.03)
    task.cancel()
    await asyncio.sleep(0.2)
    assert engine.events == ["saw-killed:early", "ended:early"]


async def test_decode_role_aborts_once_the_first_token_was_seen() -> None:
    engine = RecordingEngine()
    host = host_for(engine, DisaggregationMode.DECODE)
    await host.start()
    context = Context("late")
    stream = host.generate({"token_ids": [1]}, context)
    await anext(stream)
    host.cancel(context)
    await stream.aclose()
    await asyncio.sleep(0.1)
    assert engine.events[-1] == "abort:late"
    assert engine.events.count("abort:late") == 1


async def test_n_on_a_single_choice_engine_fans_out_with_derived_seeds() -> None:
    engine = RecordingEngine(tokens=3)
    host = host_for(engine)
    await host.start()
    request = {"token_ids": [1], "sampling_options": {"n": 3, "seed": 7}}
    chunks = await consume(host, request, Context("fan"))
    terminals = sorted(c["index"] for c in chunks if c.get("finish_reason"))
    assert terminals == [0, 1, 2]
    assert sorted(r["sampling_options"]["seed"] for r in engine.requests) == [7, 8, 9]
    assert {r["sampling_options"]["n"] for r in engine.requests} == {1}
    assert request["sampling_options"] == {"n": 3, "seed": 7}


async def test_cancelling_a_fanned_out_request_aborts_every_choice_once() -> None:
    engine = RecordingEngine()
    host = host_for(engine)
    await host.start()
    context = Context("fan")
    stream = host.generate({"token_ids": [1], "sampling_options": {"n": 3}}, context)
    await anext(stream)
    host.cancel(context)
    await stream.aclose()
    await asyncio.sleep(0.1)
    aborts = sorted(e for e in engine.events if e.startswith("abort:"))
    assert aborts == ["abort:fan-0", "abort:fan-1", "abort:fan-2"]
    assert not any(e.startswith("cancelled-error") for e in engine.events)


class HttpStatusError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@pytest.mark.parametrize(
    ("error", "status", "message"),
    [
        (ValueError("temperature must be positive"), 400, "temperature must be positive"),
        (TypeError("max_tokens must be an int"), 400, "max_tokens must be an int"),
        (HttpStatusError(415, "unsupported image type"), 415, "unsupported image type"),
        (HttpStatusError(500, "secret stack"), 500, "Internal server error"),
        (TimeoutError("kv transfer"), 504, "The engine timed out"),
        (ConnectionResetError("peer"), 503, "Service temporarily unavailable"),
        (RuntimeError("secret detail"), 500, "Internal server error"),
    ],
)
async def test_engine_exceptions_map_to_statuses(
    error: BaseException, status: int, message: str
) -> None:
    engine = RecordingEngine()
    engine.error = error
    host = host_for(engine)
    await host.start()
    with pytest.raises(PenstockError) as caught:
        await consume(host, {"token_ids": [1]}, Context())
    assert (caught.value.status_code, caught.value.message) == (status, message)


class BareEngine(dynamo_base("LLMEngine")):  # type: ignore[misc]
    """Written for Dynamo, implementing only the required methods."""

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[BareEngine, WorkerConfig]:
        return cls(), WorkerConfig(namespace="test")

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model="bare")

    async def cleanup(self) -> None:
        pass

    async def generate(
        self, request: dict[str, Any], context: Context
    ) -> AsyncGenerator[dict[str, Any], None]:
        for i in range(3):
            if context.is_stopped():
                yield {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
                return
            await asyncio.sleep(0.005)
            yield {
                "token_ids": [i + 1],
                "index": 0,
                **({"finish_reason": "length"} if i == 2 else {}),
            }


async def test_an_engine_lacking_every_optional_method_serves_with_the_defaults(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from penstock.app.server import build_gateway

    with caplog.at_level(logging.WARNING):
        gateway = await build_gateway(
            Settings(engine="bare"), engine=BareEngine(), worker_config=WorkerConfig("test")
        )
    try:
        assert gateway.host.health_check_payload is None
        async for http in asgi_client(gateway):
            reply = await http.post(
                "/v1/completions", json={"model": "bare", "prompt": [1, 2], "max_tokens": 3}
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["finish_reason"] == "length"
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200
            context = Context("no-abort")
            gateway.host.cancel(context)
            await asyncio.sleep(0.01)
    finally:
        await gateway.host.cleanup()
    assert "Traceback" not in caplog.text and "canary disabled" not in caplog.text
