"""Automatic prefix caching in the transformers engine: what a repeated prompt reuses,
what it reports, and every way the cache is invalidated."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from tests.engines.transformers.conftest import peft_greedy, start_engine
from tests.engines.transformers.helpers import greedy, hf_greedy, run

# Two full blocks of 16 and eight tokens more.
LONG_PROMPT = [(7 * i) % 50 + 3 for i in range(40)]


def _cached(choice: Any) -> int:
    return choice.usage["prompt_tokens_details"]["cached_tokens"]


def _usage(engine: TransformersEngine) -> Any:
    assert engine.scheduler is not None
    return engine.scheduler.usage()


async def test_a_repeated_prompt_takes_its_full_blocks_and_decodes_the_same(
    engine: TransformersEngine, tiny_model_dir: Path
) -> None:
    expected = hf_greedy(tiny_model_dir, LONG_PROMPT, 12)
    cold = (await run(engine, greedy(LONG_PROMPT, max_tokens=12)))[0]
    warm = (await run(engine, greedy(LONG_PROMPT, max_tokens=12)))[0]
    assert (_cached(cold), _cached(warm)) == (0, 32)
    assert cold.token_ids == warm.token_ids == expected
    # The next turn of a conversation starts with the whole first prompt.
    turn = LONG_PROMPT + expected + [9, 10, 11]
    follow_up = (await run(engine, greedy(turn, max_tokens=6)))[0]
    assert _cached(follow_up) == 48
    assert follow_up.token_ids == hf_greedy(tiny_model_dir, turn, 6)


async def test_with_caching_off_nothing_is_reused_and_tokens_are_the_same(
    tiny_model_dir: Path,
) -> None:
    engine = await start_engine(tiny_model_dir, "--no-enable-prefix-caching")
    try:
        first = (await run(engine, greedy(LONG_PROMPT, max_tokens=12)))[0]
        second = (await run(engine, greedy(LONG_PROMPT, max_tokens=12)))[0]
        usage = _usage(engine)
    finally:
        await engine.cleanup()
    assert (_cached(first), _cached(second)) == (0, 0)
    assert first.token_ids == second.token_ids == hf_greedy(tiny_model_dir, LONG_PROMPT, 12)
    assert usage.prefill_tokens == 2 * len(LONG_PROMPT) and usage.cached_blocks == 0


async def test_eight_requests_with_one_prompt_prefill_it_about_once(
    tiny_model_dir: Path,
) -> None:
    prompt = [(5 * i) % 60 + 2 for i in range(100)]
    engine = await start_engine(tiny_model_dir, "--max-num-seqs", "8")
    try:
        answers = await asyncio.gather(
            *(run(engine, greedy(prompt, max_tokens=8)) for _ in range(8))
        )
        usage = _usage(engine)
    finally:
        await engine.cleanup()
    assert usage.prefill_tokens <= 2 * len(prompt)
    assert sorted(_cached(a[0]) for a in answers) == [0] + [96] * 7
    assert all(a[0].token_ids == answers[0][0].token_ids for a in answers)


async def test_n_choices_share_one_prefill(engine: TransformersEngine) -> None:
    request = {**greedy(LONG_PROMPT, max_tokens=4), "sampling_options": {"n": 4}}
    await run(engine, request)
    assert _usage(engine).prefill_tokens == len(LONG_PROMPT)


async def test_flush_cache_forgets_every_prefix(engine: TransformersEngine) -> None:
    await run(engine, greedy(LONG_PROMPT, max_tokens=2))
    reply = await engine.engine_control("flush_cache", {})
    assert reply["status"] == "ok"
    assert _usage(engine).cached_blocks == 0
    assert _cached((await run(engine, greedy(LONG_PROMPT, max_tokens=2)))[0]) == 0


async def test_new_weights_never_hit_a_prefix_the_old_ones_computed(
    engine: TransformersEngine, other_tiny_model_dir: Path
) -> None:
    await run(engine, greedy(LONG_PROMPT, max_tokens=2))
    await engine.engine_control("pause_generation", {"mode": "wait"})
    reply = await engine.engine_update(
        "update_weights_from_disk", {"model_path": str(other_tiny_model_dir)}
    )
    assert reply["status"] == "ok"
    await engine.engine_control("resume_generation", {})
    after = (await run(engine, greedy(LONG_PROMPT, max_tokens=10)))[0]
    assert _cached(after) == 0
    assert after.token_ids == hf_greedy(other_tiny_model_dir, LONG_PROMPT, 10)


async def test_an_adapter_never_hits_the_prefix_of_the_base_or_of_another_adapter(
    engine: TransformersEngine,
    tiny_model_dir: Path,
    tiny_lora_dir: Path,
    second_tiny_lora_dir: Path,
) -> None:
    async def load(path: Path) -> None:
        reply = await engine.engine_update(
            "load_lora", {"lora_name": "adapter", "lora_path": str(path)}
        )
        assert reply["status"] == "ok"

    request = {**greedy(LONG_PROMPT, max_tokens=6), "model": "adapter"}
    await run(engine, greedy(LONG_PROMPT, max_tokens=2))
    await load(tiny_lora_dir)
    first = (await run(engine, request))[0]
    again = (await run(engine, request))[0]
    assert (_cached(first), _cached(again)) == (0, 32)
    assert first.token_ids == again.token_ids
    assert first.token_ids == peft_greedy(tiny_model_dir, tiny_lora_dir, LONG_PROMPT, 6)
    await engine.engine_update("unload_lora", {"lora_name": "adapter"})
    await load(second_tiny_lora_dir)
    other = (await run(engine, request))[0]
    assert _cached(other) == 0
    assert other.token_ids == peft_greedy(tiny_model_dir, second_tiny_lora_dir, LONG_PROMPT, 6)


async def test_the_blocks_an_answer_filled_serve_the_next_turn_for_every_choice(
    engine: TransformersEngine, tiny_model_dir: Path
) -> None:
    sampled = {
        "token_ids": LONG_PROMPT,
        "sampling_options": {"n": 2, "temperature": 1.0, "seed": 5},
        "stop_conditions": {"max_tokens": 30, "ignore_eos": True},
    }
    first = await run(engine, sampled)
    assert first[0].token_ids != first[1].token_ids
    for index in (0, 1):
        # 40 prompt tokens and 29 of the answer have KV (the last one is never fed back).
        turn = LONG_PROMPT + first[index].token_ids + [9, 10, 11]
        follow_up = (await run(engine, greedy(turn, max_tokens=6)))[0]
        assert _cached(follow_up) == 64
        assert follow_up.token_ids == hf_greedy(tiny_model_dir, turn, 6)


async def test_a_preempted_request_recomputes_from_the_blocks_it_had_filled(
    tiny_model_dir: Path,
) -> None:
    # Twelve blocks of 16: three requests of 66 tokens (five blocks each) do not fit.
    prompts = [[5 + i, 9, 13 + i, 20, 4 + 2 * i, 30] for i in range(3)]
    expected = [hf_greedy(tiny_model_dir, prompt, 60) for prompt in prompts]
    counts = {}
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        engine = await start_engine(
            tiny_model_dir, caching, "--kv-cache-tokens", "192", "--max-num-seqs", "3"
        )
        try:
            answers = await asyncio.gather(
                *(run(engine, greedy(prompt, max_tokens=60)) for prompt in prompts)
            )
            counts[caching] = _usage(engine)
        finally:
            await engine.cleanup()
        assert [a[0].token_ids for a in answers] == expected
    cached, uncached = counts["--enable-prefix-caching"], counts["--no-enable-prefix-caching"]
    assert cached.preemptions > 0 and uncached.preemptions > 0
    assert cached.cached_tokens > 0
    assert cached.prefill_tokens < uncached.prefill_tokens


async def test_an_answer_decoded_across_a_weight_update_is_never_cached(
    engine: TransformersEngine, other_tiny_model_dir: Path
) -> None:
    started = asyncio.Event()
    received: list[int] = []

    async def consume() -> None:
        async for chunk in engine.generate(greedy(LONG_PROMPT, max_tokens=40), Context("kept")):
            received.extend(chunk["token_ids"])
            started.set()

    consumer = asyncio.create_task(consume())
    await started.wait()
    await engine.engine_control("pause_generation", {"mode": "keep"})
    reply = await engine.engine_update(
        "update_weights_from_disk", {"model_path": str(other_tiny_model_dir)}
    )
    assert reply["status"] == "ok"
    await engine.engine_control("resume_generation", {})
    await consumer
    assert len(received) == 40
    after = (await run(engine, greedy(LONG_PROMPT + received, max_tokens=4)))[0]
    assert _cached(after) == 0


class _Recorder:
    def __init__(self) -> None:
        self.stored: list[dict[str, Any]] = []
        self.removed: list[list[int]] = []
        self.cleared = 0

    def publish_stored(self, **event: Any) -> None:
        self.stored.append(event)

    def publish_removed(self, block_hashes: list[int]) -> None:
        self.removed.append(block_hashes)

    def clear_all(self) -> None:
        self.cleared += 1


async def test_kv_events_follow_the_blocks_stored_evicted_and_cleared(
    tiny_model_dir: Path,
) -> None:
    # Six blocks: a second prompt of three full blocks evicts the first one's idle blocks.
    engine = await start_engine(tiny_model_dir, "--kv-cache-tokens", "96")
    recorder = _Recorder()
    try:
        (source,) = await engine.kv_event_sources()
        source.on_ready(recorder)
        await run(engine, greedy(LONG_PROMPT, max_tokens=2))
        (stored,) = recorder.stored
        assert stored["num_block_tokens"] == [16, 16]
        assert stored["token_ids"] == LONG_PROMPT[:32]
        other = [(3 * i) % 40 + 4 for i in range(64)]
        await run(engine, greedy(other, max_tokens=2))
        removed = {block for event in recorder.removed for block in event}
        assert removed and removed <= set(stored["block_hashes"])
        await engine.engine_control("flush_cache", {})
        assert recorder.cleared == 1
        text = engine.prometheus_text()
    finally:
        await engine.cleanup()
    assert 'penstock_engine_kv_cached_blocks{model="' in text
    assert 'penstock_engine_prefill_tokens_total{model="' in text
