"""The KV block pool alone: matching, sharing, LRU eviction with its events, reset."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from penstock.engines.transformers.args import parse_args
from penstock.engines.transformers.core.block_manager import (
    BLOCK_SIZE,
    BlockManager,
    PoolExhausted,
    chain_hashes,
    pool_tokens,
)


class Events:
    def __init__(self) -> None:
        self.stored: list[int] = []
        self.removed: list[int] = []
        self.cleared = 0

    def manager(self, blocks: int, *, prefix_caching: bool = True) -> BlockManager:
        def cleared() -> None:
            self.cleared += 1

        return BlockManager(
            blocks,
            prefix_caching=prefix_caching,
            on_stored=lambda hashes, _tokens: self.stored.extend(hashes),
            on_removed=self.removed.extend,
            on_cleared=cleared,
        )


def _prefill(manager: BlockManager, tokens: list[int]) -> list:
    """What the scheduler does for one prompt: match, allocate the rest, store it."""
    match = manager.match(tokens, None)
    full = len(tokens) // BLOCK_SIZE
    blocks = match.blocks + manager.allocate(-(-len(tokens) // BLOCK_SIZE) - len(match.blocks))
    manager.store(blocks, match.hashes, tokens, len(match.blocks))
    assert len(blocks) >= full
    return blocks


def test_a_prompt_seen_before_matches_its_full_blocks_but_never_its_last_token() -> None:
    events = Events()
    manager = events.manager(8)
    prompt = list(range(40))
    first = _prefill(manager, prompt)
    assert len(events.stored) == 2
    again = manager.match(prompt, None)
    assert again.tokens == 32 and again.blocks == first[:2]
    # A prompt of exactly two blocks keeps its second block to compute its last token.
    assert manager.match(prompt[:32], None).tokens == 16
    # Another adapter computed other KV for the same tokens.
    assert manager.match(prompt, "lora1").tokens == 0
    # One differing token in the first block changes every hash after it.
    assert manager.match([99, *prompt[1:]], None).tokens == 0


def test_a_block_held_by_two_sequences_is_freed_once_both_let_go() -> None:
    manager = Events().manager(4)
    prompt = list(range(33))
    blocks = _prefill(manager, prompt)
    assert manager.free_blocks == 1
    shared = manager.match(prompt, None).blocks
    manager.free(blocks)
    # Still held by the second match: not free, not evictable.
    assert manager.free_blocks == 2
    manager.free(shared)
    assert manager.free_blocks == 4 and manager.cached_blocks == 2


def test_idle_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    events = Events()
    manager = events.manager(4)
    older = _prefill(manager, list(range(32)))
    newer = _prefill(manager, list(range(100, 132)))
    manager.free(older)
    manager.free(newer)
    stored = list(events.stored)
    manager.allocate(1)
    # A chain's tail goes first, its head after.
    assert events.removed == [stored[1]]
    manager.allocate(1)
    assert events.removed == [stored[1], stored[0]]
    assert manager.match([*list(range(32)), 0], None).tokens == 0
    assert manager.match([*list(range(100, 132)), 0], None).tokens == 32


def test_an_empty_pool_refuses_and_takes_nothing() -> None:
    manager = Events().manager(2)
    manager.allocate(1)
    with pytest.raises(PoolExhausted):
        manager.allocate(2)
    assert manager.free_blocks == 1


def test_reset_forgets_every_cached_block_even_held_ones() -> None:
    events = Events()
    manager = events.manager(4)
    prompt = list(range(40))
    held = _prefill(manager, prompt)
    manager.reset()
    assert events.cleared == 1
    assert manager.cached_blocks == 0
    assert manager.match(prompt, None).tokens == 0
    manager.free(held)
    assert manager.free_blocks == 4 and manager.cached_blocks == 0


def test_without_prefix_caching_nothing_is_stored_or_matched() -> None:
    events = Events()
    manager = events.manager(4, prefix_caching=False)
    prompt = list(range(40))
    _prefill(manager, prompt)
    assert events.stored == [] and manager.match(prompt, None).tokens == 0


def test_chain_hashes_name_each_block_by_everything_before_it() -> None:
    first = chain_hashes(list(range(32)), "salt")
    second = chain_hashes(list(range(16)) + list(range(50, 66)), "salt")
    assert len(first) == 2 and first[0] == second[0] and first[1] != second[1]
    assert chain_hashes(list(range(15)), "salt") == []


def test_a_sequence_stores_the_blocks_its_output_filled() -> None:
    events = Events()
    manager = events.manager(8)
    prompt = list(range(20))
    blocks = _prefill(manager, prompt) + manager.allocate(1)
    computed = prompt + list(range(100, 130))
    manager.store_computed(blocks, computed, None, manager.epoch)
    # The prompt's one full block was stored at prefill; the output filled two more.
    assert len(events.stored) == 3
    manager.free(blocks)
    match = manager.match([*computed, 7], None)
    assert match.tokens == 48 and match.blocks == blocks[:3]


def test_kv_computed_before_a_reset_is_never_stored_after_it() -> None:
    events = Events()
    manager = events.manager(8)
    prompt = list(range(40))
    blocks = _prefill(manager, prompt)
    epoch = manager.epoch
    manager.reset()
    manager.store_computed(blocks, prompt, None, epoch)
    manager.free(blocks)
    assert manager.cached_blocks == 0
    assert manager.match(prompt, None).tokens == 0


def test_the_default_pool_fits_a_share_of_the_memory_and_one_context_at_least() -> None:
    def config(hidden: int) -> SimpleNamespace:
        return SimpleNamespace(
            num_attention_heads=1, num_key_value_heads=1, hidden_size=hidden, num_hidden_layers=1
        )

    cpu = torch.device("cpu")
    args = parse_args(["--max-num-seqs", "4"])
    assert pool_tokens(args, config(64), torch.float32, cpu, 1000) == 4000
    # 8 MiB of KV a token: a share of any machine's memory holds fewer than 4,000 tokens.
    assert pool_tokens(args, config(2**20), torch.float32, cpu, 1000) < 4000
    assert pool_tokens(args, config(2**30), torch.float32, cpu, 1000) == 1000
    assert (
        pool_tokens(
            parse_args(["--kv-cache-tokens", "64"]), config(2**30), torch.float32, cpu, 1000
        )
        == 64
    )
