"""The CPU kernels on one thread and on several: the same bits, whoever computes a chunk.

The kernels share a call's columns (or attention rows) between the calling thread and
helpers (``kernels/work_share.h``); every output is summed by one thread in one order, so
the thread count must not change a single bit, also when calls come thick and fast (each
a new job for the helpers) or from two Python threads at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.kernels import paged_attention
from penstock.engines.transformers.weights import cpu_weights

THREADS = [1, 2, 3]


@pytest.fixture(scope="module")
def kernel() -> object:
    failure = cpu_weights.load_kernel(default_model_cache_dir())
    if failure is not None:
        pytest.skip(failure)
    return cpu_weights._kernel


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _on_threads(threads: int, call: object, *args: object) -> torch.Tensor:
    torch.set_num_threads(threads)
    return call(*args)  # type: ignore[operator]


@pytest.mark.parametrize("rows", [1, 4, 7, 16, 64])
def test_linear_kernels_give_the_same_bits_on_any_thread_count(
    kernel: object, restore_threads: None, rows: int
) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator)
    weight = torch.randn(1000, 576, generator=generator).bfloat16()
    quantized, scales = cpu_weights.quantize_int8(weight.float())
    for name, args in (("bf16_linear", (x, weight)), ("int8_linear", (x, quantized, scales))):
        call = getattr(kernel, name)
        alone = _on_threads(1, call, *args)
        for threads in THREADS[1:]:
            assert torch.equal(_on_threads(threads, call, *args), alone), (name, threads)


def test_many_short_calls_in_a_row_each_get_their_own_answer(
    kernel: object, restore_threads: None
) -> None:
    """Each call is a new job for the helpers: none may mix a chunk of one into another."""
    generator = torch.Generator().manual_seed(7)
    weights = [torch.randn(64 + 36 * i, 64, generator=generator).bfloat16() for i in range(6)]
    inputs = [torch.randn(1 + i % 3, 64, generator=generator) for i in range(6)]
    torch.set_num_threads(1)
    expected = [kernel.bf16_linear(x, w) for x, w in zip(inputs, weights, strict=True)]  # type: ignore[attr-defined]
    torch.set_num_threads(2)
    for _ in range(300):
        for x, w, want in zip(inputs, weights, expected, strict=True):
            assert torch.equal(kernel.bf16_linear(x, w), want)  # type: ignore[attr-defined]


def test_two_python_threads_calling_at_once_both_get_their_answers(
    kernel: object, restore_threads: None
) -> None:
    generator = torch.Generator().manual_seed(11)
    pairs = [
        (
            torch.randn(16, 576, generator=generator),
            torch.randn(900, 576, generator=generator).bfloat16(),
        )
        for _ in range(2)
    ]
    torch.set_num_threads(1)
    expected = [kernel.bf16_linear(x, w) for x, w in pairs]  # type: ignore[attr-defined]
    torch.set_num_threads(2)
    wrong: list[int] = []

    def call(index: int) -> None:
        x, w = pairs[index]
        for _ in range(40):
            if not torch.equal(kernel.bf16_linear(x, w), expected[index]):  # type: ignore[attr-defined]
                wrong.append(index)

    callers = [threading.Thread(target=call, args=(index,)) for index in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert wrong == []


def test_paged_attention_gives_the_same_bits_on_any_thread_count(restore_threads: None) -> None:
    failure = paged_attention.load_attention_kernel(default_model_cache_dir())
    if failure is not None:
        pytest.skip(failure)
    generator = torch.Generator().manual_seed(5)
    block_size, blocks, rows = 16, 40, 9
    keys = torch.randn(blocks * block_size, 3, 64, generator=generator)
    values = torch.randn(blocks * block_size, 3, 64, generator=generator)
    table = torch.randperm(blocks, generator=generator)[: rows * 4].view(rows, 4).int().contiguous()
    lengths = torch.tensor([1 + 7 * row for row in range(rows)], dtype=torch.int32)
    query = torch.randn(rows, 9, 64, generator=generator)
    args = (query, keys, values, table, lengths, 0.125, block_size)
    alone = _on_threads(1, paged_attention.paged_attention, *args)
    for threads in THREADS[1:]:
        assert torch.equal(_on_threads(threads, paged_attention.paged_attention, *args), alone)


def test_a_forked_child_computes_with_helpers_of_its_own(
    kernel: object, restore_threads: None
) -> None:
    """A fork copies no helper thread (nor a lock one held): the child's calls still
    complete, with the same bits."""
    generator = torch.Generator().manual_seed(13)
    x, weight = torch.randn(16, 576, generator=generator), torch.randn(2000, 576).bfloat16()
    torch.set_num_threads(2)
    expected = kernel.bf16_linear(x, weight)  # type: ignore[attr-defined]
    child = os.fork()
    if child == 0:
        ok = all(torch.equal(kernel.bf16_linear(x, weight), expected) for _ in range(20))  # type: ignore[attr-defined]
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        finished, status = os.waitpid(child, os.WNOHANG)
        if finished:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    pytest.fail("the forked child's kernel call did not return")
