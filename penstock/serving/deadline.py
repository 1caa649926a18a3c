"""Request deadlines: ``X-Request-Timeout``, ``--request-timeout-s`` and what expiry does.

A chat or completions request may carry ``X-Request-Timeout: <seconds>`` (a positive
float); without it the server's ``request_timeout_s`` applies, and with neither there is
no deadline. A value above ``max_request_timeout_s`` is lowered to it. The clock starts
when the route begins serving the request, so it covers preprocessing, the admission
queue and generation.

When the deadline passes while the response waits on the engine (or on preprocessing),
that wait is cancelled, which cancels the engine request and has the host call the
engine's ``abort`` once, as for a client disconnect, and the waiter raises
:class:`~penstock.errors.RequestTimeoutError`: a 408 before the first byte, an error
frame and ``[DONE]`` after it. One timer per request does this, not one per chunk: the
streaming hot path pays an attribute store per chunk, and nothing without a deadline.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from penstock.errors import InvalidRequestError, RequestTimeoutError
from penstock.settings import Settings

T = TypeVar("T")

TIMEOUT_HEADER = "X-Request-Timeout"
_TIMEOUT_KEY = TIMEOUT_HEADER.lower().encode()


def header(request: Request, name: bytes) -> str | None:
    """The request's header ``name`` (lowercase bytes, as ASGI gives them), or None.

    A scan of the raw pairs: Starlette's ``Headers.get`` pays an exception for each header
    that is absent, and these are looked up on every request.
    """
    headers: list[tuple[bytes, bytes]] = request.scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def requested_timeout(request: Request, settings: Settings) -> float | None:
    """The request's time budget in seconds, or None; 400 for a header that is no budget."""
    raw = header(request, _TIMEOUT_KEY)
    if raw is None:
        return settings.request_timeout_s
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(
            f"{TIMEOUT_HEADER} must be a positive number of seconds; got {raw!r}",
            param=TIMEOUT_HEADER,
        )
    cap = settings.max_request_timeout_s
    return seconds if cap is None else min(seconds, cap)


def request_deadline(request: Request, settings: Settings) -> Deadline | None:
    seconds = requested_timeout(request, settings)
    return None if seconds is None else Deadline(seconds)


class Deadline:
    """The moment one response must be complete by, and the timer that enforces it.

    Waits go through :meth:`within`; the timer cancels the task only while it is inside
    one, so a deadline passing while a stream is writing to a slow client is noticed at
    the next wait instead of interrupting the write.
    """

    __slots__ = ("_timer", "_waiting", "at", "expired", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = asyncio.get_running_loop().time() + seconds
        # Set before the waiting task is cancelled, so whoever sees that cancellation can
        # tell a deadline from a client that went away.
        self.expired = False
        self._waiting: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def error(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"The request did not complete within its {self.seconds:g} s deadline",
            param=TIMEOUT_HEADER,
        )

    async def within(self, awaitable: Awaitable[T]) -> T:
        """The result of ``awaitable``; :class:`RequestTimeoutError` once the deadline has
        passed, before or while it runs."""
        if self.expired:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise self.error()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(self.at, self._expire)
        task = asyncio.current_task()
        self._waiting = task
        try:
            return await awaitable
        except BaseException as exc:
            # Whatever escapes ends the response, so the timer has nothing left to guard.
            self.close()
            # Only a cancellation of our own making becomes the timeout; one from elsewhere
            # (the client left) is still pending after ours is withdrawn.
            if (
                isinstance(exc, asyncio.CancelledError)
                and self.expired
                and task is not None
                and task.uncancel() == 0
            ):
                raise self.error() from None
            raise
        finally:
            self._waiting = None

    def close(self) -> None:
        """The response is done: drop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self.expired = True
        self._timer = None
        if self._waiting is not None:
            self._waiting.cancel()
