"""The replica's end of the data plane: a request's chunks sent to the ingress in batches.

A message through a Serve handle costs milliseconds, so each message carries every chunk
the engine produced since the previous one. The engine runs on from the moment the
request arrives, filling a queue, while the replica sends what is there. A
:class:`~penstock.errors.PenstockError` ends the stream as its last entry
(:func:`penstock.ray.wire.error_entry`); the ingress (:class:`~penstock.ray.fleet.FleetHost`)
raises it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from penstock.errors import PenstockError
from penstock.ray.wire import error_entry

logger = logging.getLogger(__name__)

_END = object()


class ChunkBatcher:
    """Runs ``chunks`` into a queue from construction on; :meth:`next_batch` drains it."""

    def __init__(self, chunks: AsyncIterator[dict[str, Any]], label: str) -> None:
        self._label = label
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._ended = False
        self._pump = asyncio.get_running_loop().create_task(self._run(chunks))

    async def next_batch(self) -> list[dict[str, Any]] | None:
        """Every chunk produced since the last call, waiting for one; ``None`` once the
        stream has ended."""
        if self._ended:
            return None
        batch = [await self._queue.get()]
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        if batch[-1] is _END:
            self._ended = True
            batch.pop()
            return batch or None
        return batch

    async def close(self) -> None:
        """Stop the chunks' source if it still runs (cancelling the engine request)."""
        if not self._pump.done():
            self._pump.cancel()
            with contextlib.suppress(BaseException):
                await self._pump

    async def _run(self, chunks: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for chunk in chunks:
                self._queue.put_nowait(chunk)
        except PenstockError as exc:
            self._queue.put_nowait(error_entry(exc))
        except Exception:
            logger.exception("%s failed", self._label)
            self._queue.put_nowait(error_entry(PenstockError("Internal server error")))
        self._queue.put_nowait(_END)
