"""Admission: a cap on concurrent engine requests and a bounded wait queue.

Requests over the cap wait in arrival order; when the queue is full too, they are
refused at once with the overload status and ``Retry-After``, before any engine work.
"""

from __future__ import annotations

import asyncio
from collections import deque

from penstock.errors import OverloadedError

RETRY_AFTER_S = 1


class AdmissionGate:
    """Counts engine requests in flight; a freed slot goes straight to the next waiter."""

    def __init__(self, max_active: int, max_queued: int, overload_status: int = 529) -> None:
        if max_active < 1 or max_queued < 0:
            raise ValueError("max_active must be >= 1 and max_queued >= 0")
        self.max_active = max_active
        self.max_queued = max_queued
        self.overload_status = overload_status
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.active < self.max_active and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queued:
            error = OverloadedError(
                f"Server overloaded: {self.active} requests running and {self.queued} "
                "waiting; retry later",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            error.status_code = self.overload_status
            raise error
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1
