"""A long prompt prefilled in chunks beside decoding rows: each chunk rides in the rows'
decode pass, its size counted with its attention over the prompt before it, and every
output stays what ``generate`` gives."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from penstock.engines.context import Context
from penstock.engines.transformers.core.block_manager import Match
from penstock.engines.transformers.core.chunk_pacing import LEAST_CHUNK_TOKENS
from penstock.engines.transformers.core.model_runner import PrefillRow
from penstock.engines.transformers.core.prefill_plan import Prefiller, chunk_cost, chunk_end
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import greedy, hf_greedy, run

LONG = [(13 * i) % 80 + 3 for i in range(200)]
BESIDE = [5, 6, 7, 8, 9, 10, 11]


async def test_a_stream_and_a_prompt_chunked_beside_it_both_give_generates_tokens(
    tiny_model_dir: Path,
) -> None:
    engine = await start_engine(tiny_model_dir, "--max-num-batched-tokens", "24")
    try:
        stream = asyncio.create_task(run(engine, greedy(BESIDE, max_tokens=60), Context("b")))
        await asyncio.sleep(0)
        long = (await run(engine, greedy(LONG, max_tokens=8), Context("long")))[0]
        beside = (await stream)[0]
        again = (await run(engine, greedy(LONG, max_tokens=8)))[0]
    finally:
        await engine.cleanup()
    assert long.token_ids == again.token_ids == hf_greedy(tiny_model_dir, LONG, 8)
    assert beside.token_ids == hf_greedy(tiny_model_dir, BESIDE, 60)
    # The chunks cached their full blocks.
    assert again.usage is not None
    assert again.usage["prompt_tokens_details"]["cached_tokens"] == 192


def test_later_chunks_of_a_prompt_take_fewer_tokens_for_the_same_budget() -> None:
    context = 1000.0
    first = chunk_end(0, 8000, 32, context)
    late = chunk_end(6000, 8000, 32, context) - 6000
    # 32 tokens from the start cost 32.5: their attention over each other counts too.
    assert first == 31 and late == 4
    assert chunk_cost(6000, late, context) <= 32 < chunk_cost(6000, late + 1, context)
    # A budget below one token still moves the prompt on, and never past its end.
    assert chunk_end(7000, 8000, 0.5, context) == 7001
    assert chunk_end(7990, 8000, 500, context) == 8000


def test_a_chunk_beside_decoding_rows_computes_a_few_tokens_at_least() -> None:
    def unused(*args: Any) -> None:
        raise AssertionError("not called")

    prefiller = Prefiller(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        accept=unused,
        cancel=unused,
        send=unused,
        context=1000.0,
    )
    submission = SimpleNamespace(wants_prompt_logits=False)
    row = PrefillRow(submission, list(range(8000)), [])  # type: ignore[arg-type]
    prefiller.chunked.append((row, Match([], [])))
    row.computed = 6000
    # Its attention reads the prompt's KV whatever its size: one token would pay that alone.
    assert prefiller.next_chunk(0.5) == (prefiller.chunked[0], 6000 + LEAST_CHUNK_TOKENS)
    assert prefiller.next_chunk(100.0) == (prefiller.chunked[0], 6000 + 14)
    row.computed = 7998
    assert prefiller.next_chunk(0.5) == (prefiller.chunked[0], 8000)
