"""KV taken as sequences grow: admission bounded by the tokens requests hold, preemption
when the pool runs out (outputs unchanged), and ``priority`` ordering admission."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from tests.engines.transformers.conftest import start_engine
from tests.engines.transformers.helpers import greedy, hf_greedy, run

PROMPTS = [[5 + i, 9, 13 + i, 20, 4 + 2 * i, 30] for i in range(4)]


async def test_more_requests_than_the_pool_holds_all_finish_unchanged(
    tiny_model_dir: Path,
) -> None:
    expected = [hf_greedy(tiny_model_dir, prompt, 60) for prompt in PROMPTS]
    # Six blocks of 16: each request alone fits (66 tokens, five blocks), four together
    # do not, so rows are preempted and recomputed.
    engine = await start_engine(tiny_model_dir, "--kv-cache-tokens", "96", "--max-num-seqs", "4")
    try:
        answers = await asyncio.gather(
            *(run(engine, greedy(prompt, max_tokens=60)) for prompt in PROMPTS)
        )
        assert engine.scheduler is not None
        usage = engine.scheduler.usage()
    finally:
        await engine.cleanup()
    assert [a[0].token_ids for a in answers] == expected
    assert all(a[0].finish_reason == "length" for a in answers)
    assert usage.preemptions > 0
    assert usage.used_blocks == 0


async def test_n_choices_preempted_together_resume_each_from_its_own_tokens(
    tiny_model_dir: Path,
) -> None:
    engine = await start_engine(tiny_model_dir, "--kv-cache-tokens", "128", "--max-num-seqs", "4")
    sampled = {
        "token_ids": PROMPTS[0],
        "sampling_options": {"n": 2, "temperature": 1.0, "seed": 3},
        "stop_conditions": {"max_tokens": 50, "ignore_eos": True},
    }
    try:
        alone = await run(engine, sampled)
        crowded, *_ = await asyncio.gather(
            run(engine, sampled),
            *(run(engine, greedy(prompt, max_tokens=50)) for prompt in PROMPTS[1:3]),
        )
        assert engine.scheduler is not None
        preemptions = engine.scheduler.usage().preemptions
    finally:
        await engine.cleanup()
    assert preemptions > 0
    assert [crowded[i].token_ids for i in (0, 1)] == [alone[i].token_ids for i in (0, 1)]


async def test_requests_decode_at_once_while_they_hold_few_tokens(
    tiny_model_dir: Path,
) -> None:
    # 512 tokens: a reservation of prompt + max_tokens (403 each) would run one at a time.
    engine = await start_engine(tiny_model_dir, "--kv-cache-tokens", "512", "--max-num-seqs", "8")
    streams = [
        engine.generate(greedy([5 + i, 6, 7], max_tokens=400), Context(f"r{i}")) for i in range(8)
    ]
    try:
        # A second token comes from a decode step: every row is in the batch by then.
        for stream in streams:
            await anext(stream)
            await anext(stream)
        assert engine.scheduler is not None
        assert engine.scheduler.usage().running == 8
    finally:
        for stream in streams:
            await stream.aclose()
        await engine.cleanup()


async def test_priority_orders_admission(engine: TransformersEngine) -> None:
    await engine.engine_control("pause_generation", {"mode": "keep"})
    finished: list[str] = []

    async def consume(name: str, priority: int) -> None:
        request = {**greedy(max_tokens=30), "priority": priority}
        await run(engine, request, Context(name))
        finished.append(name)

    tasks = [
        asyncio.create_task(consume(name, priority))
        for name, priority in (("late", 5), ("first", -1), ("second", 0))
    ]
    await asyncio.sleep(0.2)
    await engine.engine_control("resume_generation", {})
    await asyncio.gather(*tasks)
    # One row at a time (max-num-seqs 1 below) makes the finish order the admission order.
    assert finished == ["first", "second", "late"]


@pytest.fixture
async def engine(tiny_model_dir: Path):
    started = await start_engine(tiny_model_dir, "--max-num-seqs", "1")
    yield started
    await started.cleanup()


async def test_a_priority_that_is_not_an_integer_is_refused(engine: TransformersEngine) -> None:
    with pytest.raises(ValueError, match="priority: must be an integer"):
        await run(engine, {**greedy(), "priority": "high"})


async def test_a_request_larger_than_the_pool_is_refused_naming_the_option(
    tiny_model_dir: Path,
) -> None:
    engine = await start_engine(tiny_model_dir, "--kv-cache-tokens", "64")
    try:
        with pytest.raises(ValueError, match="--kv-cache-tokens"):
            await run(engine, greedy(max_tokens=100))
    finally:
        await engine.cleanup()
