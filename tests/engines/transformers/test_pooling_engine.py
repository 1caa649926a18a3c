"""The pooling engine in process: requests that wait together share forward passes and
each gets its own vectors; a stopped request ends ``cancelled``; bad inputs are refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from penstock.engines.context import Context
from penstock.engines.transformers.pooling import TransformersPoolingEngine
from penstock.errors import InvalidRequestError
from tests.support.tiny_pooling import build_tiny_bert_embedder

INPUTS = [[2, 40, 41, 3], [2, 50, 3], [2, 60, 61, 62, 63, 3]]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert_embedder(tmp_path_factory.mktemp("bert"))


@pytest.fixture
async def engine(bert_dir: Path) -> AsyncIterator[TransformersPoolingEngine]:
    started, _ = await TransformersPoolingEngine.from_args(["--model", str(bert_dir)])
    await started.start(0)
    yield started
    await started.cleanup()


async def _answer(
    engine: TransformersPoolingEngine, inputs: list[list[int]], context: Context
) -> dict[str, Any]:
    chunks = [
        chunk
        async for chunk in engine.generate({"token_ids": inputs, "pooling_task": "embed"}, context)
    ]
    assert len(chunks) == 1
    return dict(chunks[0])


async def test_waiting_requests_share_passes_and_keep_their_own_vectors(
    engine: TransformersPoolingEngine,
) -> None:
    alone = [
        (await _answer(engine, [ids], Context(f"alone-{i}")))["embeddings"][0]
        for i, ids in enumerate(INPUTS)
    ]
    passes: list[int] = []
    forward = engine._forward

    def counted(inputs: list[list[int]]) -> list[list[float]]:
        passes.append(len(inputs))
        return forward(inputs)

    engine._forward = counted  # type: ignore[method-assign]
    answers = await asyncio.gather(
        *(_answer(engine, [ids], Context(f"together-{i}")) for i, ids in enumerate(INPUTS))
    )
    assert passes == [len(INPUTS)]
    for answer, expected, ids in zip(answers, alone, INPUTS, strict=True):
        assert answer["finish_reason"] == "stop"
        assert answer["prompt_tokens"] == len(ids)
        assert (
            max(abs(a - b) for a, b in zip(answer["embeddings"][0], expected, strict=True)) < 1e-5
        )


async def test_a_stopped_request_ends_cancelled(engine: TransformersPoolingEngine) -> None:
    context = Context("stopped")
    context.stop_generating()
    assert (await _answer(engine, INPUTS, context))["finish_reason"] == "cancelled"


@pytest.mark.parametrize(
    "inputs",
    [[], [[]], [[2, 10**6]], [[2] * 65]],
)
async def test_bad_inputs_are_refused(
    engine: TransformersPoolingEngine, inputs: list[list[int]]
) -> None:
    with pytest.raises(InvalidRequestError):
        await _answer(engine, inputs, Context("bad"))
