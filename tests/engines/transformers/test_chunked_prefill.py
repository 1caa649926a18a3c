"""Chunked prefill: a prompt longer than the step's token budget is prefilled over
several steps, its output unchanged, while the streams beside it keep decoding."""

from __future__ import annotations

import asyncio
from pathlib import Path

from penstock.engines.context import Context
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import greedy, hf_greedy, run

LONG = [(11 * i) % 70 + 3 for i in range(300)]


async def test_a_long_prompt_prefilled_in_chunks_gives_generates_tokens(
    tiny_model_dir: Path,
) -> None:
    engine = await start_engine(tiny_model_dir, "--max-num-batched-tokens", "32")
    try:
        choice = (await run(engine, greedy(LONG, max_tokens=12)))[0]
        again = (await run(engine, greedy(LONG, max_tokens=12)))[0]
    finally:
        await engine.cleanup()
    assert choice.token_ids == again.token_ids == hf_greedy(tiny_model_dir, LONG, 12)
    # Chunks cache their blocks like a whole prefill does.
    assert again.usage is not None
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 288


async def test_a_decoding_stream_keeps_going_while_a_long_prompt_is_prefilled(
    tiny_model_dir: Path,
) -> None:
    engine = await start_engine(tiny_model_dir, "--max-num-batched-tokens", "16")
    events: list[str] = []

    async def follow(name: str, stream) -> None:
        async for chunk in stream:
            events.extend([name] * len(chunk["token_ids"]))

    try:
        beside = engine.generate(greedy(max_tokens=200), Context("beside"))
        events.append("beside")
        await anext(beside)
        decoding = asyncio.create_task(follow("beside", beside))
        await follow("long", engine.generate(greedy(LONG, max_tokens=1), Context("long")))
        decoding.cancel()
    finally:
        await engine.cleanup()
    # 300 prompt tokens at 15 a step (16 less the decode row): 20 steps, each one
    # decoding a token of the stream beside it before the long prompt's first token.
    assert events.index("long") >= 15
