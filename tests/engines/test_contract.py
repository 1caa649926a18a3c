"""Seed-compatible contract types: defaults, coercions and documented error dicts."""

from __future__ import annotations

import asyncio
import enum
import json
from pathlib import Path

import pytest

from penstock.engines.constants import DisaggregationMode, EmbeddingTransferMode
from penstock.engines.context import Context
from penstock.engines.contract import (
    BaseEngine,
    EngineConfig,
    LlmRegistration,
    WorkerConfig,
    parse_endpoint_types,
)
from penstock.engines.health import (
    HEALTH_CHECK_KEY,
    build_health_check_payload,
    is_probe,
    parse_health_check_payload_cli,
)
from penstock.engines.token_budget import TokenBudget
from tests.support.doubles import ScriptedEngine


def test_engine_config_positional_order_and_defaults() -> None:
    config = EngineConfig("m", "served", {"k": 1}, LlmRegistration(context_length=8))
    assert (config.model, config.served_model_name, config.runtime_data) == (
        "m",
        "served",
        {"k": 1},
    )
    assert config.llm.context_length == 8 and config.model_aliases == []
    assert LlmRegistration().max_num_seqs is None and LlmRegistration().enable_eagle is False


def test_worker_config_defaults_and_disaggregation_coercion() -> None:
    config = WorkerConfig(namespace="ns")
    assert config.model_name == "" and config.endpoint_types == "chat,completions"
    assert config.disaggregation_mode is DisaggregationMode.AGGREGATED

    class Foreign(enum.Enum):
        PREFILL = "p"

    assert WorkerConfig("ns", disaggregation_mode=Foreign.PREFILL).disaggregation_mode is (
        DisaggregationMode.PREFILL
    )
    with pytest.raises(TypeError):
        WorkerConfig("ns", disaggregation_mode="prefill")


def test_worker_config_from_runtime_config() -> None:
    class Runtime:
        component = None
        endpoint_types = "images"
        dyn_tool_call_parser = "hermes"
        serving_mode = DisaggregationMode.DECODE
        health_check_payload = '{"prompt": "x"}'

    config = WorkerConfig.from_runtime_config(Runtime(), "folder", served_model_name="s")
    assert config.component == "backend" and config.endpoint_types == "images"
    assert config.tool_call_parser == "hermes"
    assert config.disaggregation_mode is DisaggregationMode.DECODE
    assert config.health_check_payload == {"prompt": "x", HEALTH_CHECK_KEY: True}
    assert WorkerConfig.from_runtime_config(Runtime(), "f", endpoint="x").endpoint == "x"


def test_enums_have_the_seed_values() -> None:
    assert [m.value for m in DisaggregationMode] == ["agg", "prefill", "decode", "encode"]
    assert [m.value for m in EmbeddingTransferMode] == ["local", "nixl-write", "nixl-read"]


def test_endpoint_types_parsing() -> None:
    assert parse_endpoint_types(" Chat, ,video,image ") == {"chat", "videos", "images"}
    with pytest.raises(ValueError, match="unknown endpoint type 'prefill'"):
        parse_endpoint_types("chat,prefill")
    with pytest.raises(ValueError, match="cannot be empty"):
        parse_endpoint_types(" , ")


async def test_unsupported_controls_and_updates_return_the_documented_dicts() -> None:
    engine = ScriptedEngine()
    assert isinstance(engine, BaseEngine)
    assert engine.supported_controls() == set() and engine.supported_updates() == set()
    assert await engine.engine_control("pause_generation", {}) == {
        "status": "error",
        "message": "unsupported engine control: pause_generation",
    }
    assert await engine.engine_update("update_weights", {}) == {
        "status": "error",
        "message": "unsupported engine update: update_weights",
    }
    assert await engine.is_quiescent() is None
    assert engine.component_metrics_dp_ranks() == []


def test_token_budget_validates_the_limit() -> None:
    assert TokenBudget(10, True, False).as_runtime_data()["combined_limit"] == 10
    with pytest.raises(ValueError):
        TokenBudget(-1, True, True)


def test_health_payload_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_HEALTH_CHECK_PAYLOAD", raising=False)
    payload = build_health_check_payload(7, extras={"model": "m"})
    assert payload["token_ids"] == [7] and payload["model"] == "m" and is_probe(payload)
    assert not is_probe({HEALTH_CHECK_KEY: 1})
    file = tmp_path / "canary.json"
    file.write_text(json.dumps({"token_ids": [3]}))
    assert parse_health_check_payload_cli(f"@{file}") == {"token_ids": [3], HEALTH_CHECK_KEY: True}
    assert parse_health_check_payload_cli("[1]") is None
    assert parse_health_check_payload_cli("{broken") is None
    monkeypatch.setenv("DYN_HEALTH_CHECK_PAYLOAD", "{}")
    assert build_health_check_payload(7) == {HEALTH_CHECK_KEY: True}


async def test_context_cancellation_ids_and_trace_headers() -> None:
    context = Context("req-1", {"x-request-id": "req-1"})
    assert context.id() == "req-1" and not context.is_stopped()
    waiter = asyncio.create_task(context.async_killed_or_stopped())
    await asyncio.sleep(0)
    context.stop_generating()
    assert await asyncio.wait_for(waiter, 1) is True
    assert context.is_stopped() and not context.is_killed()
    context.kill()
    assert context.is_killed()
    child = context.detached("req-2")
    assert child.id() == "req-2" and not child.is_stopped()
    assert child.metadata == {"x-request-id": "req-1"}
    assert Context().id() != Context().id()

    traced = Context(traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    headers = traced.trace_headers()
    assert headers is not None and headers["traceparent"].startswith("00-" + "a" * 32)
    assert traced.parent_span_id == "b" * 16
    assert Context().trace_headers() is None
