"""The embedding cache: bounded by bytes, LRU, exact deltas; concurrent misses compute once."""

from __future__ import annotations

import asyncio

import pytest
import torch

from penstock.memory import CachedEmbedding, CacheMutation, MultimodalEmbeddingCacheManager
from penstock.multimodal import AsyncEncoderCache


def entry(nbytes: int) -> CachedEmbedding:
    return CachedEmbedding(torch.zeros(nbytes, dtype=torch.int8), image_grid_thw=[1, 2, 2])


def test_lru_eviction_by_bytes_reports_the_delta() -> None:
    cache = MultimodalEmbeddingCacheManager(100)
    assert cache.set_with_delta("a", entry(40)) == CacheMutation(True, ["a"], [])
    assert cache.set("b", entry(40))
    assert cache.get("a") is not None  # a is now the most recent
    assert cache.set_with_delta("c", entry(40)) == CacheMutation(True, ["c"], ["b"])
    assert cache.keys() == ["a", "c"]
    assert cache.set_with_delta("a", entry(60)) == CacheMutation(True, [], [])
    assert cache.keys() == ["c", "a"] and cache.current_bytes == 100
    assert cache.set_with_delta("huge", entry(101)) == CacheMutation(False, [], [])
    assert cache.keys() == ["c", "a"]
    assert cache.make_room_for("c", 90) == (True, ["a"])
    assert cache.keys() == [] and cache.make_room_for("x", 101) == (False, [])
    assert cache.get("gone") is None
    stats = cache.stats
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 1, 2)
    assert stats["hit_rate"] == 0.5 and stats["utilization"] == 0
    assert entry(3).image_grid_thw == [1, 2, 2] and entry(3).video_timestamps is None


def test_entries_are_sized_by_their_dtype_and_must_be_contiguous() -> None:
    cache = MultimodalEmbeddingCacheManager(64)
    assert cache.set("f32", CachedEmbedding(torch.zeros(4, 4)))
    assert cache.current_bytes == 64
    with pytest.raises(ValueError, match="contiguous"):
        cache.set("t", CachedEmbedding(torch.zeros(4, 4).t()))
    assert MultimodalEmbeddingCacheManager(0).stats["utilization"] == 0


async def test_concurrent_misses_for_one_key_compute_once() -> None:
    cache = AsyncEncoderCache(MultimodalEmbeddingCacheManager(1 << 20))
    calls = 0
    release = asyncio.Event()

    async def encode() -> CachedEmbedding:
        nonlocal calls
        calls += 1
        await release.wait()
        return entry(16)

    waiters = [asyncio.create_task(cache.get_or_compute("img", encode)) for _ in range(8)]
    await asyncio.sleep(0)
    assert cache.stats["in_flight"] == 1
    release.set()
    results = await asyncio.gather(*waiters)
    assert calls == 1 and all(r is results[0] for r in results)
    assert cache.get("img") is results[0] and cache.stats["in_flight"] == 0
    assert await cache.get_or_compute("img", encode) is results[0] and calls == 1


async def test_a_failed_computation_reaches_every_waiter_and_is_retried() -> None:
    cache = AsyncEncoderCache(MultimodalEmbeddingCacheManager(1 << 20))
    gate = asyncio.Event()

    async def broken() -> CachedEmbedding:
        await gate.wait()
        raise RuntimeError("encoder failed")

    waiters = [asyncio.create_task(cache.get_or_compute("k", broken)) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(o, RuntimeError) for o in outcomes)

    async def working() -> CachedEmbedding:
        return entry(8)

    assert (await cache.get_or_compute("k", working)).tensor.numel() == 8
