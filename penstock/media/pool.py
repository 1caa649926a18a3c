"""A bounded pool of asyncio workers running generations in submission order.

At most ``size`` generations run at once; the rest wait in a FIFO queue and can report
their 1-based position, or leave it before they start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

Work = Callable[[], Awaitable[None]]


class WorkerPool:
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("the media worker pool needs at least one worker")
        self.size = size
        self._pending: OrderedDict[str, Work] = OrderedDict()
        self._running: set[str] = set()
        self._wakeup = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self._workers:
            self._workers = [
                asyncio.get_running_loop().create_task(self._worker(), name=f"media-worker-{i}")
                for i in range(self.size)
            ]

    async def stop(self) -> None:
        """Stop the workers; running generations are cancelled, queued ones dropped."""
        workers, self._workers = self._workers, []
        for task in workers:
            task.cancel()
        for task in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pending.clear()

    def submit(self, key: str, work: Work) -> None:
        if key in self._pending or key in self._running:
            raise ValueError(f"{key} is already in the pool")
        self._pending[key] = work
        self._wakeup.set()

    def position(self, key: str) -> int | None:
        """1-based place in the queue; None when ``key`` is not waiting."""
        for index, pending in enumerate(self._pending, start=1):
            if pending == key:
                return index
        return None

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    def withdraw(self, key: str) -> bool:
        """Take a waiting item out of the queue; False if it is not waiting."""
        return self._pending.pop(key, None) is not None

    async def _worker(self) -> None:
        while True:
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            key, work = self._pending.popitem(last=False)
            self._running.add(key)
            try:
                await work()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("media generation %s failed outside its handler", key)
            finally:
                self._running.discard(key)
