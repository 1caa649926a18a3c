"""Which input an engine gets follows from the contract base it derives from."""

from __future__ import annotations

import abc
from typing import Any

import pytest

from penstock.engines.constants import ModelInput
from penstock.engines.contract import WorkerConfig, model_input_of
from penstock.engines.host import EngineHost
from penstock.engines.samples.diffusion import SampleDiffusionEngine
from penstock.engines.samples.engine import SampleLLMEngine
from penstock.errors import EngineLoadError
from tests.support.doubles import NotAnEngine, ScriptedEngine


def dynamo_base(name: str) -> type:
    """A stand-in for ``dynamo.common.backend.<name>``: same module and name, no Dynamo."""
    return type(name, (abc.ABC,), {"__module__": "dynamo.common.backend.engine"})


class DuckTypedEngine:
    """Has every method of an engine but derives from no contract base."""

    async def from_args(self, argv: list[str] | None = None) -> Any: ...
    async def start(self, worker_id: int) -> Any: ...
    async def generate(self, request: Any, context: Any) -> Any: ...
    async def cleanup(self) -> None: ...
    async def kv_event_sources(self) -> list[Any]:
        return []


def test_token_engines_take_tokens() -> None:
    assert model_input_of(SampleLLMEngine) is ModelInput.Tokens
    assert model_input_of(ScriptedEngine()) is ModelInput.Tokens


def test_raw_and_diffusion_engines_take_the_request_body() -> None:
    assert model_input_of(SampleDiffusionEngine) is ModelInput.Text


@pytest.mark.parametrize(
    ("base", "expected"),
    [("LLMEngine", ModelInput.Tokens), ("RawEngine", ModelInput.Text)],
)
def test_engines_written_for_dynamo_qualify_by_their_base(base: str, expected: ModelInput) -> None:
    written_for_dynamo = type("VendorEngine", (dynamo_base(base),), {})
    assert model_input_of(written_for_dynamo) is expected


def test_a_same_named_class_outside_dynamo_does_not_qualify() -> None:
    lookalike = type("LLMEngine", (), {"__module__": "somewhere.else"})
    with pytest.raises(EngineLoadError, match="is not an engine"):
        model_input_of(type("Engine", (lookalike,), {}))


@pytest.mark.parametrize("engine", [NotAnEngine(), DuckTypedEngine()])
def test_the_host_refuses_what_is_neither(engine: object) -> None:
    with pytest.raises(EngineLoadError, match="must derive from LLMEngine or RawEngine"):
        EngineHost(engine, WorkerConfig(namespace="test"))  # type: ignore[arg-type]


def test_the_host_knows_a_raw_engine_from_its_base() -> None:
    raw_host = EngineHost(SampleDiffusionEngine("sample-video"), WorkerConfig(namespace="test"))
    token_host = EngineHost(ScriptedEngine(), WorkerConfig(namespace="test"))
    assert (raw_host.model_input, raw_host.is_raw) == (ModelInput.Text, True)
    assert (token_host.model_input, token_host.is_raw) == (ModelInput.Tokens, False)
