"""Async access to the embedding cache, computing each missing key once.

Concurrent callers of :meth:`AsyncEncoderCache.get_or_compute` for one key share one
computation: the first runs ``compute_fn`` and stores the result, the others await it
(an exception reaches every waiter, and the next call computes again). Not thread-safe:
one event loop owns it, as it owns the cache below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from penstock.memory import CachedEmbedding, MultimodalEmbeddingCacheManager


class AsyncEncoderCache:
    """Async wrapper with request coalescing over MultimodalEmbeddingCacheManager."""

    def __init__(self, cache: MultimodalEmbeddingCacheManager) -> None:
        self.cache = cache
        self._in_flight: dict[str, asyncio.Future[CachedEmbedding]] = {}

    def get(self, key: str) -> CachedEmbedding | None:
        """Synchronous get from the underlying cache."""
        return self.cache.get(key)

    async def get_or_compute(
        self, key: str, compute_fn: Callable[[], Awaitable[CachedEmbedding]]
    ) -> CachedEmbedding:
        """The cached entry, else the result of the computation already running for
        ``key``, else a new computation's (stored in the cache). Re-raises its exception."""
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        running = self._in_flight.get(key)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[CachedEmbedding] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            entry = await compute_fn()
            self.cache.set(key, entry)
            future.set_result(entry)
            return entry
        except BaseException as exc:
            if not isinstance(exc, Exception):
                exc = RuntimeError(f"the computation of {key} was cancelled")
            future.set_exception(exc)
            # Retrieved here so an exception nobody else awaited is not logged as lost.
            future.exception()
            raise
        finally:
            del self._in_flight[key]

    @property
    def stats(self) -> dict[str, float | int]:
        return {**self.cache.stats, "in_flight": len(self._in_flight)}
