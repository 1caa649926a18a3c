"""Admission: a cap on concurrent engine requests and a bounded wait queue.

Requests over the cap wait in arrival order; when the queue is full too, they are
refused at once with the overload status and ``Retry-After``, before any engine work.
Refusals are expected under load, so they are not logged one by one: one WARNING line
per interval says how many were shed and why.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from penstock.errors import OverloadedError

RETRY_AFTER_S = 1
SHED_LOG_INTERVAL_S = 10.0

logger = logging.getLogger(__name__)


class AdmissionGate:
    """Counts engine requests in flight; a freed slot goes straight to the next waiter."""

    def __init__(
        self,
        max_active: int,
        max_queued: int,
        overload_status: int = 529,
        *,
        shed_log_interval_s: float = SHED_LOG_INTERVAL_S,
    ) -> None:
        if max_active < 1 or max_queued < 0:
            raise ValueError("max_active must be >= 1 and max_queued >= 0")
        self.max_active = max_active
        self.max_queued = max_queued
        self.overload_status = overload_status
        self.shed_log_interval_s = shed_log_interval_s
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._shed = 0
        self._shed_log: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def capacity(self) -> int:
        """The most engine requests the gate holds at once, running and waiting."""
        return self.max_active + self.max_queued

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
            self._count_shed()
            raise error
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over just as the caller went away: pass it on.
                self.release()
            elif waiter in self._waiters:
                # A ``release`` in between may already have dropped the cancelled waiter;
                # removing it twice would turn a disconnect into an internal error.
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def _count_shed(self) -> None:
        self._shed += 1
        if self._shed_log is None:
            self._shed_log = asyncio.get_running_loop().call_later(
                self.shed_log_interval_s, self._log_shed
            )

    def _log_shed(self) -> None:
        count, self._shed, self._shed_log = self._shed, 0, None
        logger.warning(
            "shed %d request%s in the last %gs (queue full: max_concurrency=%d, max_queue=%d)",
            count,
            "" if count == 1 else "s",
            self.shed_log_interval_s,
            self.max_active,
            self.max_queued,
        )
