"""The diffusion engine's abort control: the shared body and answer, runs stopped at the
next denoising step."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from penstock.engines.context import Context
from penstock.engines.diffusion import DiffusersEngine

VIDEO: dict[str, Any] = {
    "prompt": "a red kite over the sea",
    "size": "64x48",
    "response_format": "b64_json",
    "nvext": {"num_frames": 5, "num_inference_steps": 30, "seed": 11, "fps": 6},
}


@pytest.fixture
async def engine() -> AsyncIterator[DiffusersEngine]:
    built, _ = await DiffusersEngine.from_args([])
    await built.start(1)
    yield built
    await built.cleanup()


@pytest.mark.parametrize("body", [{"abort_all": True}, {"request_id": "video-1"}])
async def test_abort_request_stops_the_run_in_flight(
    engine: DiffusersEngine, body: dict[str, Any]
) -> None:
    assert "abort_request" in engine.supported_controls()
    chunks = []
    async for chunk in engine.generate(dict(VIDEO), Context("video-1")):
        chunks.append(chunk)
        if len(chunks) == 1:
            reply = await engine.engine_control("abort_request", body)
            assert reply == {"status": "ok", "aborted": ["video-1"]}
    assert chunks[-1]["status"] == "failed" and chunks[-1]["error"] == "cancelled"
    assert chunks[-2]["step"] < 30
    assert await engine.engine_control("abort_request", {"abort_all": True}) == {
        "status": "ok",
        "aborted": [],
    }


async def test_a_bad_abort_body_is_refused(engine: DiffusersEngine) -> None:
    reply = await engine.engine_control("abort_request", {"request_ids": "video-1"})
    assert reply["status"] == "error" and "request_id" in reply["message"]
    unknown = await engine.engine_control("sleep", {})
    assert unknown == {"status": "error", "message": "unsupported engine control: sleep"}
