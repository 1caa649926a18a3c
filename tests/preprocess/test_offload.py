"""Small work stays on the event loop; large work goes to the bounded worker threads."""

from __future__ import annotations

import asyncio
import threading

from penstock.preprocess.offload import PreprocessPool


def test_small_inputs_run_inline_and_large_ones_on_a_worker() -> None:
    pool = PreprocessPool(workers=2, inline_size=100)

    async def thread_names() -> tuple[str, str]:
        small = await pool.run(100, lambda: threading.current_thread().name)
        large = await pool.run(101, lambda: threading.current_thread().name)
        return small, large

    small, large = asyncio.run(thread_names())
    assert small == threading.current_thread().name
    assert large.startswith("penstock-preprocess")


def test_at_most_workers_run_at_once() -> None:
    pool = PreprocessPool(workers=2, inline_size=0)
    running = 0
    most = 0
    lock = threading.Lock()
    release = threading.Event()

    def work() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(5)
        with lock:
            running -= 1

    async def many() -> None:
        tasks = [asyncio.ensure_future(pool.run(1, work)) for _ in range(6)]
        await asyncio.sleep(0.2)
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(many())
    assert most == 2
