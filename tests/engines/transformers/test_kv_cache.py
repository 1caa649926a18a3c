"""The in-place batch KV cache holds what a padded, concatenated cache would, step by step."""

from __future__ import annotations

import random

import torch

from penstock.engines.transformers.kv_cache import BatchKv

LAYERS, HEADS, DIM = 2, 3, 4


def prefilled(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.randn(1, HEADS, length, DIM), torch.randn(1, HEADS, length, DIM))
        for _ in range(LAYERS)
    ]


def dense(rows: list[list[tuple[torch.Tensor, torch.Tensor]]], layer: int, width: int) -> tuple:
    """What the batch must look like: each row's own KV right-aligned on zeros."""
    keys = torch.zeros(len(rows), HEADS, width, DIM)
    values = torch.zeros(len(rows), HEADS, width, DIM)
    for index, row in enumerate(rows):
        k, v = row[layer]
        keys[index, :, width - k.shape[-2] :] = k[0]
        values[index, :, width - v.shape[-2] :] = v[0]
    return keys, values


def test_rows_joining_leaving_and_decoding_match_a_padded_cache() -> None:
    torch.manual_seed(0)
    pick = random.Random(0)
    cache: BatchKv | None = None
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for _ in range(60):
        action = pick.random()
        if rows and action < 0.2:
            keep = sorted(pick.sample(range(len(rows)), pick.randrange(len(rows))))
            if not keep:
                cache, rows = None, []
                continue
            assert cache is not None
            order = cache.keep_rows(keep)
            assert sorted(order) == keep
            rows = [rows[i] for i in order]
            cache.set_width(max(r[0][0].shape[-2] for r in rows), headroom=5)
        elif action < 0.45 and len(rows) < 8:
            joining = [prefilled(pick.randrange(1, 40)) for _ in range(pick.randrange(1, 3))]
            if cache is None:
                cache = BatchKv(joining[0], row_capacity=len(joining))
            rows += joining
            cache.set_width(max(r[0][0].shape[-2] for r in rows), headroom=5)
            cache.add_rows(joining, max_rows=8)
        elif cache is not None:
            cache.reserve(1, limit=5)
            new = [(torch.randn(len(rows), HEADS, 1, DIM), torch.randn(len(rows), HEADS, 1, DIM))]
            new *= LAYERS
            for layer, (k, v) in enumerate(new):
                cache.update(k, v, layer)
            rows = [
                [
                    (torch.cat([kv[0], k[i : i + 1]], -2), torch.cat([kv[1], v[i : i + 1]], -2))
                    for kv, (k, v) in zip(row, new, strict=True)
                ]
                for i, row in enumerate(rows)
            ]
        if cache is None:
            continue
        width = max(r[0][0].shape[-2] for r in rows)
        assert cache.width == width and cache.rows == len(rows)
        for layer in range(LAYERS):
            keys, values = dense(rows, layer, width)
            assert torch.equal(cache.layers[layer].keys, keys)
            assert torch.equal(cache.layers[layer].values, values)


def test_a_cache_mostly_unused_after_rows_leave_is_reallocated_smaller() -> None:
    torch.manual_seed(1)
    rows = [prefilled(60) for _ in range(7)] + [prefilled(2)]
    cache = BatchKv(rows[0], row_capacity=len(rows))
    cache.set_width(60, headroom=100)
    cache.add_rows(rows, max_rows=8)
    before = cache.layers[0].key_buffer.numel()
    assert cache.keep_rows([7]) == [7]
    cache.set_width(2, headroom=100)
    assert cache.layers[0].key_buffer.numel() * 10 < before
    for layer in range(LAYERS):
        keys, values = dense(rows[7:], layer, 2)
        assert torch.equal(cache.layers[layer].keys, keys)
        assert torch.equal(cache.layers[layer].values, values)


def test_a_long_row_joins_into_buffers_prepared_before_it() -> None:
    torch.manual_seed(2)
    rows = [prefilled(5), prefilled(40)]
    cache = BatchKv(rows[0], row_capacity=1)
    cache.set_width(5, headroom=10)
    cache.add_rows(rows[:1], max_rows=4)
    assert cache.reallocates(2, 40) and not cache.reallocates(1, 5)
    prepared = cache.prepare(2, 60, 41)
    assert cache.prepare(2, 80, 45) is prepared
    for buffer in prepared.buffers:
        buffer.fill_(7.0)
    # Zeroed in part before the join; the join zeroes the rest.
    prepared.zero(prepared.elements // 3)
    cache.set_width(40, headroom=10)
    cache.add_rows(rows[1:], max_rows=4)
    assert cache.prepared is None
    for layer in range(LAYERS):
        keys, values = dense(rows, layer, 40)
        assert torch.equal(cache.layers[layer].keys, keys)
        assert torch.equal(cache.layers[layer].values, values)
        joined = cache.layers[layer]
        assert joined.key_buffer is prepared.buffers[2 * layer]
        assert not joined.key_buffer[:, :, : joined.start].any()
        assert not joined.key_buffer[:, :, joined.end :].any()


def test_columns_grow_into_buffers_zeroed_while_the_rows_decoded() -> None:
    torch.manual_seed(3)
    rows = [prefilled(40), prefilled(25)]
    cache = BatchKv(rows[0], row_capacity=2)
    cache.set_width(40, headroom=200)
    cache.add_rows(rows, max_rows=2)
    capacity = cache.layers[0].column_capacity
    prepared = None
    while cache.layers[0].column_capacity == capacity:
        cache.reserve(1, limit=200)
        if cache.grown is not None:
            prepared = cache.grown
        new = [
            (torch.randn(2, HEADS, 1, DIM), torch.randn(2, HEADS, 1, DIM)) for _ in range(LAYERS)
        ]
        for layer, (k, v) in enumerate(new):
            cache.update(k, v, layer)
        rows = [
            [
                (torch.cat([kv[0], k[i : i + 1]], -2), torch.cat([kv[1], v[i : i + 1]], -2))
                for kv, (k, v) in zip(row, new, strict=True)
            ]
            for i, row in enumerate(rows)
        ]
    assert prepared is not None and cache.grown is None
    width = cache.width
    for layer in range(LAYERS):
        assert cache.layers[layer].key_buffer is prepared.buffers[2 * layer]
        keys, values = dense(rows, layer, width)
        assert torch.equal(cache.layers[layer].keys, keys)
        assert torch.equal(cache.layers[layer].values, values)


def test_rows_that_end_within_the_free_columns_prepare_no_growth() -> None:
    rows = [prefilled(40)]
    cache = BatchKv(rows[0], row_capacity=1)
    cache.set_width(40, headroom=10)
    cache.add_rows(rows, max_rows=1)
    free = cache.layers[0].column_capacity - cache.layers[0].end
    assert 2 * free <= cache.width
    cache.reserve(1, limit=free)
    assert cache.grown is None
    cache.reserve(1, limit=free + 1)
    assert cache.grown is not None


def test_a_long_row_leaving_shrinks_the_layers_one_per_step_with_the_kv_unchanged() -> None:
    torch.manual_seed(5)
    layers = 6
    short, long = (
        [(torch.randn(1, HEADS, length, DIM), torch.randn(1, HEADS, length, DIM))] * layers
        for length in (3, 200)
    )
    cache = BatchKv(short, row_capacity=2)
    cache.set_width(200, headroom=4)
    cache.add_rows([short, long], max_rows=2)
    for _ in range(4):
        cache.reserve(1, limit=4)
        for layer in range(layers):
            keys, values, _, _ = cache.decode_column(layer)
            keys.fill_(1.0)
            values.fill_(1.0)
    held = cache.held_bytes
    assert cache.keep_rows([0]) == [0]
    cache.set_width(7, headroom=layers + 8)
    # Only the first layer is reallocated at once; the others have no free column left
    # and make room in place.
    assert cache.layers[0].column_capacity < cache.layers[-1].column_capacity
    assert cache.layers[-1].column_capacity == cache.layers[-1].end
    ones = torch.ones(1, HEADS, 4, DIM)
    expected = [torch.cat([kv, ones], -2) for kv in short[0]]
    for step in range(layers + 8):
        cache.reserve(1, limit=layers + 8 - step)
        for layer in range(layers):
            keys, values, _, _ = cache.decode_column(layer)
            keys.fill_(step)
            values.fill_(-step)
        column = torch.full((1, HEADS, 1, DIM), float(step))
        expected = [torch.cat([expected[0], column], -2), torch.cat([expected[1], -column], -2)]
        for layer in range(layers):
            assert torch.equal(cache.layers[layer].keys, expected[0])
            assert torch.equal(cache.layers[layer].values, expected[1])
    tight = sum(layer.key_buffer.nbytes + layer.value_buffer.nbytes for layer in cache.layers)
    assert cache.held_bytes == tight
    assert tight * 10 < held
