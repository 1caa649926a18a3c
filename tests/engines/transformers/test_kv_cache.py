"""The KV pool's arena alone: prompts written into blocks anywhere in the pool, read back,
and a decode step's attention over each row's own slots, in place and gathered."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.core.block_manager import BLOCK_SIZE
from penstock.engines.transformers.core.kv_cache import KvArena, StepKv
from penstock.engines.transformers.kernels import paged_attention

LAYERS, KV_HEADS, HEADS, DIM = 2, 2, 6, 16


def _arena(blocks: int) -> KvArena:
    return KvArena(
        layers=LAYERS,
        blocks=blocks,
        kv_heads=KV_HEADS,
        head_dim=DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def _prompt_kv(tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (1, KV_HEADS, tokens, DIM)
    return [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(LAYERS)
    ]


def test_a_prompt_written_into_scattered_blocks_reads_back_whole() -> None:
    arena = _arena(8)
    layers = _prompt_kv(40, seed=1)
    blocks = [6, 1, 3]
    # Written in two parts, as a prompt prefilled in chunks is.
    arena.write_prompt(arena.slots(blocks, 0, 16), layers, 0)
    arena.write_prompt(arena.slots(blocks, 16, 40), layers, 16)
    read = arena.read(arena.slots(blocks, 0, 40))
    assert read.shape == (LAYERS, 2, KV_HEADS, 40, DIM)
    for index, (keys, values) in enumerate(layers):
        assert torch.equal(read[index, 0], keys[0]) and torch.equal(read[index, 1], values[0])
    assert arena.slots(blocks, 15, 18).tolist() == [6 * 16 + 15, 16, 17]


def test_gathered_rows_are_right_aligned_over_zeros_with_a_mask() -> None:
    arena = _arena(4)
    step = StepKv(arena, [([2], 3), ([0, 1], 17)])
    slots, mask = step.gathered()
    assert step.width == 18
    assert slots[0, -4:].tolist() == [32, 33, 34, 35] and slots[1, 0].item() == 0
    assert (slots[0, :14] == arena.pad_slot).all()
    assert mask is not None and mask[0, 0, 0].tolist() == [False] * 14 + [True] * 4
    assert arena.keys[:, arena.pad_slot :].eq(0).all()
    # This step's slot for each row: right after its last token.
    assert step.slots.tolist() == [2 * 16 + 3, 16 + 1]


@pytest.mark.parametrize("lengths", [[1, 1], [5, 40, 17], [33, 2, 64, 16]])
def test_the_kernel_attends_as_the_padded_batch_does(lengths: list[int]) -> None:
    failure = paged_attention.load_attention_kernel(default_model_cache_dir())
    if failure is not None:
        pytest.skip(failure)
    arena = _arena(20)
    order = torch.randperm(20, generator=torch.Generator().manual_seed(2)).tolist()
    rows = []
    for index, length in enumerate(lengths):
        need = -(-length // BLOCK_SIZE)
        blocks, order = order[:need], order[need:]
        arena.write_prompt(arena.slots(blocks, 0, length), _prompt_kv(length, index), 0)
        rows.append((blocks, length - 1))
    step = StepKv(arena, rows)
    assert step.in_place
    query = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(3))
    for layer in range(LAYERS):
        in_place = step.attend(layer, query, 0.25)
        slots, mask = step.gathered()
        gathered = paged_attention.gathered_attention(
            query, arena.keys[layer], arena.values[layer], slots, mask, 0.25
        )
        torch.testing.assert_close(in_place, gathered, atol=1e-6, rtol=1e-5)
        # And each row alone, over exactly its tokens.
        for row, (blocks, before) in enumerate(rows):
            kv = arena.read(arena.slots(blocks, 0, before + 1))[layer]
            alone = F.scaled_dot_product_attention(
                query[row].view(KV_HEADS, HEADS // KV_HEADS, DIM), kv[0], kv[1], scale=0.25
            )
            torch.testing.assert_close(in_place[row], alone.reshape(HEADS, DIM))


def test_the_kernel_refuses_a_table_outside_the_pool() -> None:
    failure = paged_attention.load_attention_kernel(default_model_cache_dir())
    if failure is not None:
        pytest.skip(failure)
    arena = _arena(2)
    query = torch.zeros(1, HEADS, DIM)
    outside = torch.tensor([[5]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block out of the pool"):
        paged_attention.paged_attention(
            query,
            arena.keys[0],
            arena.values[0],
            outside,
            torch.tensor([3], dtype=torch.int32),
            1.0,
            16,
        )
    with pytest.raises(RuntimeError, match="row length out of its table"):
        paged_attention.paged_attention(
            query,
            arena.keys[0],
            arena.values[0],
            torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([17], dtype=torch.int32),
            1.0,
            16,
        )
