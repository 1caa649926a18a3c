"""An LRU cache of encoder embeddings bounded by bytes, not entries.

An entry's size is its tensor's ``element_size() * numel()``. Mutations report the keys
they added and removed (:class:`CacheMutation`) so a caller that mirrors the cache's
contents elsewhere (a router's view of which worker holds what) can apply the exact delta.

Not thread-safe: it is meant for one asyncio event loop (see
:class:`penstock.multimodal.AsyncEncoderCache`), which keeps it lock-free.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


class CachedEmbedding(NamedTuple):
    tensor: torch.Tensor
    image_grid_thw: list[Any] | None = None
    video_grid_thw: list[Any] | None = None
    second_per_grid_ts: float | None = None
    video_timestamps: list[float] | None = None


class CacheMutation(NamedTuple):
    stored: bool
    added_keys: list[str]
    removed_keys: list[str]


class CacheReservation(NamedTuple):
    admitted: bool
    removed_keys: list[str]


def _size_of(entry: CachedEmbedding) -> int:
    tensor = entry.tensor
    if not tensor.is_contiguous():
        raise ValueError("a cached embedding must be a contiguous tensor")
    return tensor.element_size() * tensor.numel()


class MultimodalEmbeddingCacheManager:
    """LRU cache for encoder embeddings, keyed by content hash, evicting the least
    recently used entries once ``capacity_bytes`` would be exceeded."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.current_bytes = 0
        self._entries: OrderedDict[str, tuple[CachedEmbedding, int]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: str) -> CachedEmbedding | None:
        """The entry under ``key`` (now the most recently used), or None."""
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found[0]

    def keys(self) -> list[str]:
        """The keys, least recently used first."""
        return list(self._entries)

    def set(self, key: str, entry: CachedEmbedding) -> bool:
        return self.set_with_delta(key, entry).stored

    def set_with_delta(self, key: str, entry: CachedEmbedding) -> CacheMutation:
        """Store ``entry``, replacing any under ``key`` and evicting LRU entries to fit.

        An entry larger than the whole capacity is not stored and evicts nothing.
        ``added_keys`` is ``[key]`` only when the key is new (a replacement adds nothing).
        """
        size = _size_of(entry)
        if size > self.capacity_bytes:
            return CacheMutation(False, [], [])
        replaced = self._drop(key)
        removed = self._evict_until(size)
        self._entries[key] = (entry, size)
        self.current_bytes += size
        return CacheMutation(True, [] if replaced else [key], removed)

    def make_room_for(self, key: str, size_bytes: int) -> CacheReservation:
        """Evict so that ``size_bytes`` fit; an entry under ``key`` is dropped first (not
        counted as an eviction, not listed)."""
        if size_bytes > self.capacity_bytes:
            return CacheReservation(False, [])
        self._drop(key)
        return CacheReservation(True, self._evict_until(size_bytes))

    @property
    def stats(self) -> dict[str, float | int]:
        lookups = self.hits + self.misses
        return {
            "entries": len(self._entries),
            "current_bytes": self.current_bytes,
            "capacity_bytes": self.capacity_bytes,
            "utilization": self.current_bytes / self.capacity_bytes if self.capacity_bytes else 0,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "hit_rate": self.hits / lookups if lookups else 0.0,
        }

    def _drop(self, key: str) -> bool:
        found = self._entries.pop(key, None)
        if found is None:
            return False
        self.current_bytes -= found[1]
        return True

    def _evict_until(self, size: int) -> list[str]:
        removed = []
        while self._entries and self.current_bytes + size > self.capacity_bytes:
            old_key, (_, old_size) = self._entries.popitem(last=False)
            self.current_bytes -= old_size
            self.evictions += 1
            removed.append(old_key)
        return removed
