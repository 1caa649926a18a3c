"""A one-consumer inbox for the data plane's hot path: items put without waiting, taken
all at once.

Each end of the data plane hands items from one task (or protocol callback) to the one
task that sends or reads them; an :class:`asyncio.Queue` wakes its getter per item and
costs several calls per put and get, where this wakes the taker once per batch.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    """Items in order, taken all at once (:meth:`take`)."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __len__(self) -> int:
        return len(self._items)

    async def wait(self) -> None:
        """Until at least one item is here."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def take_all(self) -> list[T]:
        items = list(self._items)
        self._items.clear()
        return items

    async def take(self) -> list[T]:
        """Every item here, waiting for the first."""
        await self.wait()
        return self.take_all()
