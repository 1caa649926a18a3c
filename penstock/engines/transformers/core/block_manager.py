"""The KV block pool: fixed-size blocks, counted per sequence as its tokens are produced,
and the prefix cache over them.

A sequence holds ``ceil(kv tokens / BLOCK_SIZE)`` blocks, taken one at a time as it
grows; a pool that cannot give one makes the scheduler preempt (see :mod:`.scheduler`).
A block whose tokens are all known is named by a hash chained over every token before
it, salted with the LoRA adapter the KV was computed with, the request's ``cache_salt``
and the cache's epoch; a later
prompt starting with the same tokens under the same salt takes that block (its reference
count goes up) instead of computing its KV again. A block nobody holds any more keeps
its KV and hash until the pool needs it: such blocks are reused least recently freed
first, each leaving with a ``removed`` event. :meth:`BlockManager.reset` starts a new
epoch (new weights, a flush): no block computed before it is ever matched again.

This module counts and names blocks; their keys and values are in :mod:`.kv_cache`'s
arena, at the block's id. Blocks become matchable as their KV is written: a prompt's full
blocks at prefill, and the blocks its output filled when the sequence leaves the batch
(finished, cancelled or preempted), so the next turn of a conversation and a preempted
sequence's recompute start with them. A sequence's blocks are freed last first, so
eviction takes a chain's tail before its head. Runs on the scheduler's thread; other
threads read the counters.
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from penstock.engines.transformers.args import EngineArgs

BLOCK_SIZE = 16
# The most of a device's memory the default pool's KV takes.
POOL_MEMORY_SHARE = 0.25

# (block hashes, the tokens of each block) when blocks become matchable; hashes when
# they leave the cache; () when the cache is cleared.
StoredHook = Callable[[list[int], list[list[int]]], None]
RemovedHook = Callable[[list[int]], None]


class PoolExhausted(Exception):
    """No free block: the caller preempts a sequence, or waits."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block can be matched by a later prompt.
    hash: int | None = None
    tokens: list[int] = field(default_factory=list)


@dataclass
class Match:
    """The cached blocks a prompt starts with: held (their reference counts taken) until
    freed with the rest of the sequence's blocks."""

    blocks: list[Block]
    # Every full block of the prompt's chain hashes, matched or not.
    hashes: list[int]

    @property
    def tokens(self) -> int:
        return len(self.blocks) * BLOCK_SIZE


def kv_shape(config: object) -> tuple[int, int, int]:
    """A model ``config``'s layers, KV heads and head dimension."""
    heads = int(getattr(config, "num_attention_heads", 1))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    hidden = int(getattr(config, "hidden_size", 0))
    head_dim = int(getattr(config, "head_dim", None) or hidden // max(heads, 1))
    return int(getattr(config, "num_hidden_layers", 1)), kv_heads, head_dim


def kv_bytes_per_token(config: object, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token holds across the layers of a model ``config``."""
    layers, kv_heads, head_dim = kv_shape(config)
    return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def pool_tokens(
    args: EngineArgs, config: object, dtype: torch.dtype, device: torch.device, context: int
) -> int:
    """The pool's size in tokens (``args.kv_pool_tokens``). Its default, ``--max-num-seqs``
    sequences of ``context`` tokens, is cut to what ``POOL_MEMORY_SHARE`` of ``device``'s
    memory holds (the pool's KV is allocated at its size), one ``context`` at least."""
    token_bytes = kv_bytes_per_token(config, dtype)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fits = int(memory * POOL_MEMORY_SHARE) // max(token_bytes, 1)
    default = max(min(args.max_num_seqs * context, fits), context)
    return args.kv_pool_tokens(bytes_per_token=token_bytes, default=default)


def chain_hashes(token_ids: Sequence[int], salt: object) -> list[int]:
    """The hash of every full block of ``token_ids``, each over all tokens before it."""
    hashes: list[int] = []
    parent = hash(("penstock-kv", salt))
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash((parent, tuple(token_ids[start : start + BLOCK_SIZE])))
        hashes.append(parent)
    return hashes


class BlockManager:
    """A bounded pool of ``total_blocks`` KV blocks and the prefix cache over them."""

    def __init__(
        self,
        total_blocks: int,
        *,
        prefix_caching: bool,
        on_stored: StoredHook | None = None,
        on_removed: RemovedHook | None = None,
        on_cleared: Callable[[], None] | None = None,
    ) -> None:
        self.total_blocks = total_blocks
        self.prefix_caching = prefix_caching
        self.on_stored = on_stored
        self.on_removed = on_removed
        self.on_cleared = on_cleared
        self._blocks = [Block(i) for i in range(total_blocks)]
        self._free: deque[Block] = deque(self._blocks)
        # Held by nobody but still matchable, least recently freed first.
        self._evictable: OrderedDict[int, Block] = OrderedDict()
        self._by_hash: dict[int, Block] = {}
        self.epoch = 0
        # Counters for the metrics: prompt tokens computed and prompt tokens matched.
        self.prefill_tokens = 0
        self.cached_tokens = 0

    # -- counts ---------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can take now (idle cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._by_hash)

    # -- matching and storing -------------------------------------------------------------

    def salt(self, request_salt: object) -> tuple[int, object]:
        return (self.epoch, request_salt)

    def match(self, token_ids: Sequence[int], request_salt: object) -> Match:
        """Hold the cached blocks ``token_ids`` starts with among those stored under
        ``request_salt`` (a request's adapter and ``cache_salt``). At least its last token
        is left to compute: its logits choose the next token."""
        if not self.prefix_caching:
            return Match([], [])
        hashes = chain_hashes(token_ids, self.salt(request_salt))
        usable = (len(token_ids) - 1) // BLOCK_SIZE
        matched: list[Block] = []
        for block_hash in hashes[:usable]:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            matched.append(block)
        for block in matched:
            self._hold(block)
        return Match(matched, hashes)

    def store(
        self, blocks: Sequence[Block], hashes: Sequence[int], token_ids: Sequence[int], first: int
    ) -> None:
        """Make ``blocks[first:len(hashes)]`` matchable, their KV (of ``token_ids``) written.
        A block whose hash another block holds already stays the sequence's own."""
        if not self.prefix_caching:
            return
        stored: list[int] = []
        stored_tokens: list[list[int]] = []
        for index in range(first, len(hashes)):
            block_hash = hashes[index]
            if block_hash in self._by_hash:
                continue
            block = blocks[index]
            block.hash = block_hash
            block.tokens = list(token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            self._by_hash[block_hash] = block
            stored.append(block_hash)
            stored_tokens.append(block.tokens)
        if stored and self.on_stored is not None:
            self.on_stored(stored, stored_tokens)

    def store_computed(
        self, blocks: Sequence[Block], token_ids: Sequence[int], request_salt: object, epoch: int
    ) -> None:
        """Make the full blocks of a sequence's computed tokens ``token_ids`` matchable,
        prompt and output alike: a later turn of the conversation, or the sequence's own
        recompute after a preemption, starts with them. KV computed in an earlier
        ``epoch`` (other weights) is never stored."""
        if not self.prefix_caching or epoch != self.epoch:
            return
        hashes = chain_hashes(token_ids, self.salt(request_salt))
        first = 0
        while first < len(hashes) and blocks[first].hash == hashes[first]:
            first += 1
        if first < len(hashes):
            self.store(blocks, hashes, token_ids, first)

    # -- allocation -----------------------------------------------------------------------

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` blocks; raises :class:`PoolExhausted` (taking none) without room."""
        if count > self.free_blocks:
            raise PoolExhausted(f"{count} blocks wanted, {self.free_blocks} free")
        return [self._take() for _ in range(count)]

    def share(self, blocks: Sequence[Block]) -> list[Block]:
        """Hold ``blocks`` once more (another choice of the same prompt)."""
        for block in blocks:
            self._hold(block)
        return list(blocks)

    def free(self, blocks: Sequence[Block]) -> None:
        """Let go of ``blocks`` (a sequence's, in token order). The last ones are freed
        first, so the pool evicts a chain's tail before its head: a head alone still
        matches, a tail without its head never does."""
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is not None:
                self._evictable[block.block_id] = block
            else:
                self._free.append(block)

    def reset(self) -> None:
        """Forget every cached block: nothing computed before this call matches again."""
        self.epoch += 1
        for block in self._by_hash.values():
            block.hash = None
            block.tokens = []
        self._by_hash.clear()
        self._free.extend(self._evictable.values())
        self._evictable.clear()
        if self.on_cleared is not None:
            self.on_cleared()

    def _hold(self, block: Block) -> None:
        if block.ref_count == 0:
            self._evictable.pop(block.block_id, None)
        block.ref_count += 1

    def _take(self) -> Block:
        if self._free:
            block = self._free.popleft()
        else:
            _, block = self._evictable.popitem(last=False)
            self._forget(block)
        block.ref_count = 1
        return block

    def _forget(self, block: Block) -> None:
        if block.hash is None:
            return
        del self._by_hash[block.hash]
        removed = block.hash
        block.hash, block.tokens = None, []
        if self.on_removed is not None:
            self.on_removed([removed])


class KvEventRelay:
    """Passes the pool's stored, removed and cleared blocks to the gateway's KV event
    publisher once one is attached (``publisher``); before that they are dropped."""

    def __init__(self) -> None:
        self.publisher: Any = None

    def stored(self, hashes: list[int], tokens: list[list[int]]) -> None:
        if self.publisher is not None:
            self.publisher.publish_stored(
                token_ids=[token for block in tokens for token in block],
                num_block_tokens=[len(block) for block in tokens],
                block_hashes=hashes,
            )

    def removed(self, hashes: list[int]) -> None:
        if self.publisher is not None:
            self.publisher.publish_removed(hashes)

    def cleared(self) -> None:
        if self.publisher is not None:
            self.publisher.clear_all()
