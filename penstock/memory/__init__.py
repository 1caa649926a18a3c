"""Memory for encoder outputs (``dynamo.common.memory``): a byte-bounded LRU of embeddings."""

from penstock.memory.embedding_cache import (
    CachedEmbedding,
    CacheMutation,
    CacheReservation,
    MultimodalEmbeddingCacheManager,
)

__all__ = [
    "CacheMutation",
    "CacheReservation",
    "CachedEmbedding",
    "MultimodalEmbeddingCacheManager",
]
