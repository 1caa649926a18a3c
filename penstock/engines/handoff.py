"""The hand-off between a request's engine task and its consumer, for engines that do not
run in the consumer's task (see :class:`~penstock.engines.host.EngineHost`).

The engine's generator runs in a task of its own (:func:`pump`), handing each chunk
through a one-item :class:`Handoff`; after the request ended, that task is read to its end
and closed: :func:`wind_down` once the consumer went away (bounded by
``CANCEL_GRACE_S``), :func:`drain_after_terminal` once every terminal was delivered
(chunks after it are contract violations).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from penstock.engines.context import Context

# The host's logger: these lines are about the requests it drives.
logger = logging.getLogger("penstock.engines.host")

DRAIN_AFTER_TERMINAL_S = 5.0
# How long a cancelled request's engine stream may run on before it is closed (the
# conformance kit's bound for observing a cancellation).
CANCEL_GRACE_S = 2.0
# Handed over after the engine's last chunk.
END = object()


class Handoff:
    """The one-item channel from a request's engine task to its consumer: what
    ``asyncio.Queue(maxsize=1)`` does for one producer and one consumer, without its three
    deques (~2 KB a request) and its bookkeeping on every chunk."""

    __slots__ = ("_full", "_getter", "_item", "_loop", "_putter", "ended")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._item: tuple[Any, BaseException | None] | None = None
        self._full = False
        self._getter: asyncio.Future[None] | None = None
        self._putter: asyncio.Future[None] | None = None
        # Whether the consumer took ``END`` (through :meth:`take_chunk`).
        self.ended = False

    async def put(self, item: tuple[Any, BaseException | None]) -> None:
        while self._full:
            self._putter = self._loop.create_future()
            try:
                await self._putter
            finally:
                self._putter = None
        self.put_nowait(item)

    def put_nowait(self, item: tuple[Any, BaseException | None]) -> bool:
        """Hand ``item`` over if the slot is free (no coroutine to await); False if not."""
        if self._full:
            return False
        self._item = item
        self._full = True
        _wake(self._getter)
        return True

    def take(self) -> tuple[Any, BaseException | None] | None:
        """The item handed over, freeing the slot; None if there is none yet."""
        if not self._full:
            return None
        item = self._item
        self._item = None
        self._full = False
        _wake(self._putter)
        return item

    def handed_over(self) -> asyncio.Future[None]:
        """A future done once an item is handed over: awaited as is, with no coroutine
        around it (the consumer's wait is once a chunk)."""
        getter = self._getter = self._loop.create_future()
        return getter

    async def get(self) -> tuple[Any, BaseException | None]:
        while (item := self.take()) is None:
            await self.handed_over()
        return item

    def take_chunk(self) -> Any:
        """The consumer's side of :meth:`take`: the chunk handed over (``END`` after the
        last one), None if there is none yet; raises what the engine raised."""
        if not self._full:
            return None
        chunk, error = self._item  # type: ignore[misc]
        self._item = None
        self._full = False
        _wake(self._putter)
        if chunk is END:
            self.ended = True
        if error is not None:
            raise error
        return chunk


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def log_contract_violation(context: Context, what: str) -> None:
    logger.error("engine contract violation (request %s): %s", context.id(), what)


async def pump(agen: AsyncGenerator[dict, None], queue: Handoff) -> None:
    """Run the engine's generator, handing each chunk over, then ``END`` (with the
    exception it raised, if any)."""
    try:
        async for item in agen:
            # The consumer has nearly always taken the previous chunk by now.
            if not queue.put_nowait((item, None)):
                await queue.put((item, None))
    except Exception as exc:
        await queue.put((END, exc))
        return
    finally:
        with contextlib.suppress(Exception):
            await agen.aclose()
    await queue.put((END, None))


async def wind_down(
    pumping: asyncio.Task[None],
    queue: Handoff,
    context: Context,
    ended: bool,
    then: Callable[[Context], None],
) -> None:
    """Read a killed request's stream to its end (bounded), close it, then ``then``."""
    try:
        async with asyncio.timeout(CANCEL_GRACE_S):
            while not ended:
                chunk, _ = await queue.get()
                ended = chunk is END
                if isinstance(chunk, dict) and chunk.get("token_ids"):
                    context.notify_first_token()
    except TimeoutError:
        logger.warning(
            "engine kept request %s running %gs after its cancellation; closing it",
            context.id(),
            CANCEL_GRACE_S,
        )
    finally:
        pumping.cancel()
        then(context)


async def drain_after_terminal(
    pumping: asyncio.Task[None], queue: Handoff, context: Context
) -> None:
    """Read a completed request's stream to its end (bounded): anything more is dropped."""
    try:
        async with asyncio.timeout(DRAIN_AFTER_TERMINAL_S):
            while True:
                chunk, error = await queue.get()
                if error is not None:
                    logger.error(
                        "engine raised after the terminal (request %s): %r",
                        context.id(),
                        error,
                    )
                    return
                if chunk is END:
                    return
                log_contract_violation(context, "chunk after the terminal dropped")
    except TimeoutError:
        log_contract_violation(context, "stream kept running after the terminal")
    finally:
        pumping.cancel()
