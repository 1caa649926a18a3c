"""Every built-in engine passes the conformance kit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from penstock.engines.conformance import ConformanceError, run_conformance
from penstock.engines.context import Context
from penstock.engines.contract import GenerateChunk, GenerateRequest
from penstock.engines.loading import load_engine_class
from penstock.engines.samples.engine import SampleLLMEngine
from tests.support.doubles import CancelSafeScriptedEngine, ScriptedEngine


async def test_sample_engine_conforms() -> None:
    await run_conformance(SampleLLMEngine, ["--delay", "0.001"])


async def test_the_kit_catches_a_chunk_after_the_terminal() -> None:
    request = {"token_ids": [1], "extra_args": {"mode": "after_terminal"}}
    with pytest.raises(ConformanceError, match="ChunkAfterTerminal"):
        await run_conformance(ScriptedEngine, request=request)


async def test_the_kit_catches_an_ignored_cancel() -> None:
    long_request = {"token_ids": [1], "extra_args": {"mode": "ok"}}
    with pytest.raises(ConformanceError, match="CancellationIgnored"):
        await run_conformance(ScriptedEngine, request={"token_ids": [1]}, long_request=long_request)


class _ClaimsCancelSafety(CancelSafeScriptedEngine):
    """Advertises cancel safety, but a request cancelled mid-stream keeps its lock."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = asyncio.Lock()

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        await self.lock.acquire()
        async for chunk in super().generate(request, context):
            yield chunk
        self.lock.release()


async def test_the_kit_catches_an_engine_that_is_not_cancel_safe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("penstock.engines.conformance.STUCK_AFTER_S", 1.0)
    slow = {"token_ids": [1], "extra_args": {"mode": "slow"}}
    with pytest.raises(ConformanceError, match="CancelSafeEngineStuck"):
        await run_conformance(_ClaimsCancelSafety, request={"token_ids": [1]}, long_request=slow)


def test_builtin_engines_resolve() -> None:
    assert load_engine_class("sample") is SampleLLMEngine


async def test_sample_diffusion_engine_conforms() -> None:
    await run_conformance(load_engine_class("sample-diffusion"), ["--delay", "0.01"])


async def test_diffusion_engine_conforms() -> None:
    image = {
        "prompt": "a red ball",
        "size": "64x64",
        "response_format": "b64_json",
        "nvext": {"num_inference_steps": 2, "seed": 1},
        "extra_args": {"endpoint_type": "images"},
    }
    video = {
        "prompt": "a red ball rolling",
        "size": "64x64",
        "seconds": 4,
        "nvext": {"num_inference_steps": 20, "fps": 8, "seed": 1},
        "extra_args": {"endpoint_type": "videos"},
    }
    await run_conformance(load_engine_class("diffusion"), [], request=image, long_request=video)
