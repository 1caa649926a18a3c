"""The decode step at which a long row leaves the batch's KV (``BatchKv``), in isolation.

A batch of a ``--short``-token row beside a ``--long``-token row, SmolLM2-135M's KV shape
(30 layers, 3 KV heads, head dim 64, float32). The long row leaves; then ``--steps``
decode steps of the short row alone. Each step's CPU time (``time.thread_time``: the
machine is shared, wall time is noisy) for the leave and every step after it, median of
``--repeats``, and the buffers' size before and after.

    PYTHONPATH=. .venv/bin/python bench/batch_shrink.py [--long 8032] [--short 1400]
        [--steps 40] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from penstock.engines.transformers.kv_cache import BatchKv

LAYERS, HEADS, HEAD_DIM = 30, 3, 64


def row(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (1, HEADS, length, HEAD_DIM)
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]


def buffer_bytes(cache: BatchKv) -> int:
    return sum(
        layer.key_buffer.nbytes + layer.value_buffer.nbytes
        for layer in cache.layers  # type: ignore[attr-defined]
    )


def decode_step(cache: BatchKv, headroom: int) -> None:
    cache.reserve(1, limit=headroom)
    for index in range(LAYERS):
        keys, values, _, _ = cache.decode_column(index)
        keys.fill_(1.0)
        values.fill_(1.0)


def one_run(long: int, short: int, steps: int) -> tuple[float, list[float], int, int]:
    """The leave's CPU ms, each later step's, the buffers' bytes before and after."""
    prefilled = [row(short), row(long)]
    cache = BatchKv(prefilled[0], row_capacity=2)
    cache.set_width(long, headroom=32)
    cache.add_rows(prefilled, max_rows=2)
    for _ in range(32):
        decode_step(cache, headroom=32)
    before = buffer_bytes(cache)
    started, wall = time.thread_time(), time.perf_counter()
    cache.keep_rows([0])
    cache.set_width(short + 32, headroom=steps + 1)
    decode_step(cache, headroom=steps + 1)
    leave = (time.thread_time() - started) * 1e3
    wall = (time.perf_counter() - wall) * 1e3
    after = []
    for step in range(steps):
        started = time.thread_time()
        decode_step(cache, headroom=steps - step)
        after.append((time.thread_time() - started) * 1e3)
    print(f"  leave {leave:.1f} ms CPU ({wall:.1f} wall), later steps {sum(after):.1f} ms CPU")
    return leave, after, before, buffer_bytes(cache)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--long", type=int, default=8032)
    parser.add_argument("--short", type=int, default=1400)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [one_run(args.long, args.short, args.steps) for _ in range(args.repeats)]
    leaves = [leave for leave, _, _, _ in runs]
    later = [max(after) for _, after, _, _ in runs]
    print(f"leave step CPU ms: median {statistics.median(leaves):.1f} (runs {leaves})")
    print(f"longest later step CPU ms: median {statistics.median(later):.1f}")
    _, _, before, after = runs[-1]
    print(f"buffers: {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after")


if __name__ == "__main__":
    main()
