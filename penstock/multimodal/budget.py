"""The process-wide budget of decoded media, in bytes.

Decoded media is many times its encoded size: a 3 KB PNG can be 48 MB of RGB, a 14 KB
FLAC hundreds of MB of samples. Every image and waveform the gateway decodes is charged
to one budget before its pixels or samples are made (the size comes from the header),
and the charge follows the decoded object: it is credited back when the object is freed
(a ``weakref.finalize``), whoever held it last (the request, the engine, the image cache).

A load that would pass the budget gets 503 with ``Retry-After``: the memory belongs to
requests in flight and comes back as they end, as an overloaded server sheds load rather
than queueing it without bound. What can never fit is a 413: one item larger than the
whole budget, or a request whose own media (counted in :class:`RequestMedia`, set for its
loads through :data:`REQUEST_MEDIA`) would pass it alone.
Before refusing, the budget asks its reclaimers (the image cache) to let go of what they
keep, then collects garbage once (a finished request's media can be held by a reference
cycle until the next full collection). Freed media is handed back to the operating
system (``malloc_trim``) once enough of it has been freed, so the process's RSS comes
back near its baseline once the media is freed; the budget bounds it meanwhile.

``PENSTOCK_MEDIA_DECODED_MAX_MB`` sets the budget (default 2048 MB: one request of 16
images at the default pixel limit fits, with their transient copies).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar

from penstock.errors import OverloadedError, PayloadTooLargeError

logger = logging.getLogger(__name__)

BUDGET_ENV = "PENSTOCK_MEDIA_DECODED_MAX_MB"
DEFAULT_BUDGET_MB = 2048.0
RETRY_AFTER_S = 1
# Freed bytes between two returns of free memory to the operating system.
_TRIM_EVERY = 64 * 1024 * 1024
_MIB = 1024 * 1024


class MediaMemoryBusy(OverloadedError):
    """The decoded media of requests in flight fills the budget; retry shortly."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "media_memory_busy"


class RequestMedia:
    """Bytes one request's media has taken from the budget so far."""

    def __init__(self) -> None:
        self.bytes = 0


# Set around one request's loads; the tasks and threads they start inherit it.
REQUEST_MEDIA: ContextVar[RequestMedia | None] = ContextVar("penstock_request_media", default=None)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


class Charge:
    """Bytes taken from the budget for one item being decoded."""

    def __init__(self, budget: DecodedMediaBudget, nbytes: int) -> None:
        self._budget = budget
        self._held = nbytes

    def grow(self, nbytes: int, what: str) -> None:
        """Take ``nbytes`` more (503 when the budget is full now)."""
        self._held += self._budget.charge(nbytes, what, reclaim=False).take_all()

    def take_all(self) -> int:
        held, self._held = self._held, 0
        return held

    def keep(self, decoded: object, nbytes: int) -> None:
        """From now on ``nbytes`` follow ``decoded``'s life; the rest is credited back."""
        kept = min(nbytes, self._held)
        self.release(self._held - kept)
        self._held = 0
        weakref.finalize(decoded, self._budget.credit, kept)

    def release(self, nbytes: int | None = None) -> None:
        """Give back ``nbytes`` (all that is held when None): the decode failed or shrank."""
        amount = self._held if nbytes is None else min(nbytes, self._held)
        self._held -= amount
        self._budget.credit(amount)


class DecodedMediaBudget:
    """Bytes of decoded media the process may hold at once; thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._used = 0
        self._freed_since_trim = 0
        self._lock = threading.Lock()
        self._reclaimers: list[weakref.WeakMethod[Callable[[], None]]] = []

    @property
    def used_bytes(self) -> int:
        return self._used

    def add_reclaimer(self, reclaim: Callable[[], None]) -> None:
        """``reclaim`` (a bound method, held weakly) drops media kept only for reuse."""
        self._reclaimers.append(weakref.WeakMethod(reclaim))  # type: ignore[arg-type]

    def charge(self, nbytes: int, what: str, *, reclaim: bool = True) -> Charge:
        """Take ``nbytes`` for ``what`` (a label for messages); 413 if it can never fit,
        503 when the budget is full now. ``reclaim`` only on the thread that owns the
        reclaimers' state (the event loop)."""
        if nbytes > self.limit_bytes:
            raise self._too_large(f"{what} decodes to {nbytes / _MIB:.1f} MB")
        taken = self._take(nbytes)
        if not taken and reclaim:
            self._reclaim()
            taken = self._take(nbytes)
        if not taken:
            # Media whose request has ended may be held only by unreachable cycles (a
            # finished request's objects referring to each other) until a full collection.
            gc.collect()
            taken = self._take(nbytes)
        request = REQUEST_MEDIA.get()
        if not taken and request is not None and request.bytes + nbytes > self.limit_bytes:
            total = (request.bytes + nbytes) / _MIB
            raise self._too_large(f"the media of this request decode to {total:.1f} MB or more")
        if not taken:
            logger.warning(
                "decoded media budget full (%d of %d bytes): refused %d bytes for %s",
                self._used,
                self.limit_bytes,
                nbytes,
                what,
            )
            raise MediaMemoryBusy(
                f"The server's decoded media budget ({self.limit_bytes / _MIB:g} MB) is in "
                "use by other requests; retry shortly",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if request is not None:
            with self._lock:
                request.bytes += nbytes
        return Charge(self, nbytes)

    def _too_large(self, what: str) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"{what}, over the server's decoded media budget of "
            f"{self.limit_bytes / _MIB:g} MB ({BUDGET_ENV})",
            code="media_too_large",
        )

    def credit(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            self._used -= nbytes
            self._freed_since_trim += nbytes
            trim = self._freed_since_trim >= _TRIM_EVERY
            if trim:
                self._freed_since_trim = 0
        if trim and (malloc_trim := _malloc_trim()) is not None:
            # Large decoded buffers come from malloc's arenas, which keep freed pages.
            malloc_trim(0)

    def _take(self, nbytes: int) -> bool:
        with self._lock:
            if self._used + nbytes > self.limit_bytes:
                return False
            self._used += nbytes
            return True

    def _reclaim(self) -> None:
        for ref in list(self._reclaimers):
            reclaim = ref()
            if reclaim is None:
                self._reclaimers.remove(ref)
            else:
                reclaim()


def _budget_from_env() -> DecodedMediaBudget:
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        mb = float(raw) if raw else DEFAULT_BUDGET_MB
        if not mb > 0:
            raise ValueError("must be > 0")
    except ValueError as exc:
        logger.warning(
            "%s=%r can't be used (%s); using %g", BUDGET_ENV, raw, exc, DEFAULT_BUDGET_MB
        )
        mb = DEFAULT_BUDGET_MB
    return DecodedMediaBudget(int(mb * _MIB))


DECODED_MEDIA = _budget_from_env()
