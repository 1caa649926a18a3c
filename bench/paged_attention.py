"""Decode attention over the KV pool's blocks against SDPA over a padded batch: one layer
of SmolLM2-135M's shape (9 query heads, 3 KV heads, dim 64), one thread, random KV in
blocks scattered over the pool; µs per call, the median of ``--repeats`` timings of 30.

    PYTHONPATH=. .venv/bin/python bench/paged_attention.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.core.block_manager import BLOCK_SIZE
from penstock.engines.transformers.kernels import paged_attention

HEADS, KV_HEADS, DIM = 9, 3, 64
# Row lengths of each case: the kernel reads each row's own tokens, SDPA the longest's.
CASES = {
    "16 x 100": [100] * 16,
    "16 x 300": [300] * 16,
    "64 x 100-200": [100 + (37 * i) % 101 for i in range(64)],
    "1 x 8,000": [8000],
    "8,000 + 300": [8000, 300],
}


def microseconds(call: Callable[[], object], repeats: int) -> float:
    call()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(30):
            call()
        timings.append((time.perf_counter() - started) / 30 * 1e6)
    return statistics.median(timings)


def time_case(lengths: list[int], repeats: int) -> tuple[float, float]:
    """The kernel's and padded SDPA's µs per call for rows of ``lengths`` tokens."""
    needs = [-(-length // BLOCK_SIZE) for length in lengths]
    slots = (sum(needs) + 1) * BLOCK_SIZE
    keys, values = torch.randn(slots, KV_HEADS, DIM), torch.randn(slots, KV_HEADS, DIM)
    order = torch.randperm(sum(needs)).tolist()
    table = []
    for need in needs:
        table.append(order[:need] + [0] * (max(needs) - need))
        order = order[need:]
    blocks = torch.tensor(table, dtype=torch.int32)
    rows = torch.tensor(lengths, dtype=torch.int32)
    query = torch.randn(len(lengths), HEADS, DIM)
    padded = (len(lengths), KV_HEADS, max(lengths), DIM)
    padded_keys, padded_values = torch.randn(padded), torch.randn(padded)
    packed = query.view(len(lengths), KV_HEADS, HEADS // KV_HEADS, DIM)
    kernel = microseconds(
        lambda: paged_attention.paged_attention(
            query, keys, values, blocks, rows, 0.125, BLOCK_SIZE
        ),
        repeats,
    )
    sdpa = microseconds(
        lambda: F.scaled_dot_product_attention(packed, padded_keys, padded_values, scale=0.125),
        repeats,
    )
    return kernel, sdpa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    failure = paged_attention.load_attention_kernel(default_model_cache_dir())
    if failure is not None:
        raise SystemExit(failure)
    for name, lengths in CASES.items():
        kernel, sdpa = time_case(lengths, args.repeats)
        print(f"{name:>14}: kernel {kernel:7.0f} us, SDPA padded {sdpa:7.0f} us")


if __name__ == "__main__":
    main()
