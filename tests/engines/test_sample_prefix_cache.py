"""The sample engine's prefix cache is bounded like a real engine's KV cache."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from penstock.engines.context import Context
from penstock.engines.samples.engine import (
    KV_BLOCK_SIZE,
    SAMPLE_TOKENIZER_DIR,
    TOTAL_KV_BLOCKS,
    PrefixCache,
    SampleLLMEngine,
)
from penstock.metrics.engine_bridge import KvEventFamilies


def test_the_least_recently_used_prompts_leave_for_room() -> None:
    cache = PrefixCache(total_blocks=5)
    assert cache.add(1, 2) == [] and cache.add(2, 2) == []
    assert cache.touch(1)
    assert cache.add(3, 2) == [(2, 2)]
    assert 1 in cache and 3 in cache and 2 not in cache
    assert cache.held_blocks == 4
    assert cache.add(4, 5) == [(1, 2), (3, 2)]
    assert len(cache) == 1 and cache.held_blocks == 5
    assert not cache.touch(2)
    cache.clear()
    assert len(cache) == 0 and cache.held_blocks == 0


async def test_distinct_prompts_keep_the_cache_and_its_kv_events_within_the_blocks() -> None:
    engine = SampleLLMEngine("m", tokenizer_dir=SAMPLE_TOKENIZER_DIR, delay=0)
    await engine.start(0)
    registry = CollectorRegistry()
    families = KvEventFamilies("m", registry)
    (source,) = await engine.kv_event_sources()
    source.on_ready(families.publisher(0))
    blocks_each = 2
    prompts = [[n] * (blocks_each * KV_BLOCK_SIZE) for n in range(1, TOTAL_KV_BLOCKS)]

    async def run(prompt: list[int]) -> None:
        request = {"token_ids": prompt, "stop_conditions": {"max_tokens": 1}}
        async for _ in engine.generate(request, Context()):  # type: ignore[arg-type]
            pass

    try:
        for prompt in prompts:
            await run(prompt)
        labels = {"model": "m", "dp_rank": "0"}
        assert engine.prefix_cache.held_blocks <= TOTAL_KV_BLOCKS
        assert registry.get_sample_value("penstock_component_kv_stored_blocks", labels) == (
            engine.prefix_cache.held_blocks
        )
        stored = len(prompts)
        removed = stored - len(engine.prefix_cache)
        assert removed > 0
        events = "penstock_component_kv_events_total"
        assert registry.get_sample_value(events, {**labels, "kind": "stored"}) == stored
        assert registry.get_sample_value(events, {**labels, "kind": "removed"}) == removed
        # The latest prompt is still cached; the first one left and is a miss again.
        hits = engine._prefix_hits
        await run(prompts[-1])
        assert engine._prefix_hits == hits + 1
        await run(prompts[0])
        assert engine._prefix_hits == hits + 1
    finally:
        await engine.cleanup()
