"""The replica's end of the data plane: a request's chunks sent to the ingress in batches.

Each replica listens on one TCP port (:class:`StreamServer`, its address in the replica's
status); the ingress holds one connection to it that carries every stream between them
(the frames of :mod:`penstock.ray.wire`), so no per-message Ray machinery is on the token
path. Each frame carries every chunk the engine produced since the previous one: the
engine runs on from the moment the request arrives, filling a queue
(:class:`ChunkBatcher`), while the replica sends what is there as far as the stream's
credit allows. A :class:`~penstock.errors.PenstockError` ends the stream as its last
entry (:func:`penstock.ray.wire.error_entry`); the ingress
(:mod:`penstock.ray.streams`) raises it again.

A cancelled stream (the ingress's client left), or a lost connection (the ingress went
away), closes the stream's chunks here: the replica's host kills the request's context
and aborts it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from penstock.errors import PenstockError
from penstock.ray.inbox import Inbox
from penstock.ray.wire import (
    BATCH,
    CANCEL,
    CREDIT,
    END,
    HELLO,
    OPEN,
    WINDOW,
    FrameProtocol,
    error_entry,
)

logger = logging.getLogger(__name__)

_END = object()


class ChunkBatcher:
    """Runs ``chunks`` into a queue from construction on; :meth:`next_batch` drains it."""

    def __init__(self, chunks: AsyncIterator[dict[str, Any]], label: str) -> None:
        self._label = label
        self._inbox: Inbox[Any] = Inbox()
        self._ended = False
        self._pump = asyncio.get_running_loop().create_task(self._run(chunks))

    async def next_batch(self) -> list[dict[str, Any]] | None:
        """Every chunk produced since the last call, waiting for one; ``None`` once the
        stream has ended."""
        if self._ended:
            return None
        await self._inbox.wait()
        # One turn of the loop more: what the engine yields meanwhile rides in this batch.
        await asyncio.sleep(0)
        batch = self._inbox.take_all()
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
                self._inbox.put(chunk)
        except PenstockError as exc:
            self._inbox.put(error_entry(exc))
        except Exception:
            logger.exception("%s failed", self._label)
            self._inbox.put(error_entry(PenstockError("Internal server error")))
        self._inbox.put(_END)


# Opens a request's chunks: (request id, request, LoRA adapter or None).
StreamSource = Callable[[str, dict[str, Any], tuple[str, str] | None], AsyncIterator[dict]]


class StreamServer:
    """The replica's data plane port: serves each connection's streams from ``source``."""

    def __init__(self, source: StreamSource, token: str, label: str) -> None:
        self.source = source
        self.token = token
        self.label = label
        self.connections: set[_ReplicaConnection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str) -> str:
        """Listen on a free port of ``host``; the address ``host:port`` to connect to."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"{host}:{port}"

    def _connection(self) -> FrameProtocol:
        connection = _ReplicaConnection(self)
        self.connections.add(connection)
        return connection.protocol

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.protocol.close()


class _Stream:
    def __init__(self) -> None:
        self.credit = WINDOW
        self.credited = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class _ReplicaConnection:
    """One ingress's connection: its streams, each a task sending batches."""

    def __init__(self, server: StreamServer) -> None:
        self._server = server
        self.protocol = FrameProtocol(self._on_frame, self._on_lost, trusted=False)
        self._greeted = False
        self._streams: dict[int, _Stream] = {}

    def _on_frame(self, frame: list[Any]) -> None:
        kind = frame[0]
        if not self._greeted:
            # Only an ingress of this fleet (it holds the token) may open streams.
            self._greeted = kind == HELLO and hmac.compare_digest(str(frame[1]), self._server.token)
            if self._greeted:
                self.protocol.trust()
            else:
                logger.warning("%s: refused a data connection without the token", self._label)
                self.protocol.close()
        elif kind == OPEN:
            stream_id, request_id, request, adapter = frame[1:5]
            stream = self._streams[stream_id] = _Stream()
            adapter = tuple(adapter) if adapter else None
            stream.task = asyncio.get_running_loop().create_task(
                self._send(stream_id, stream, self._server.source(request_id, request, adapter))
            )
        elif (stream := self._streams.get(frame[1])) is not None:
            if kind == CANCEL and stream.task is not None:
                # Dropped here too: a task cancelled before it ran never reaches its finally.
                del self._streams[frame[1]]
                stream.task.cancel()
            elif kind == CREDIT:
                stream.credit += int(frame[2])
                stream.credited.set()

    async def _send(self, stream_id: int, stream: _Stream, chunks: AsyncIterator[dict]) -> None:
        batcher = ChunkBatcher(chunks, f"{self._server.label}: stream {stream_id}")
        try:
            while (batch := await batcher.next_batch()) is not None:
                while stream.credit <= 0:
                    stream.credited.clear()
                    await stream.credited.wait()
                stream.credit -= 1
                await self.protocol.drain()
                if not self._send_batch(stream_id, batch):
                    break
            self.protocol.send(END, stream_id)
        finally:
            self._streams.pop(stream_id, None)
            await batcher.close()

    def _send_batch(self, stream_id: int, batch: list[dict[str, Any]]) -> bool:
        """Send ``batch``; a chunk that cannot be encoded ends its own stream with an error
        (``False``), not the connection's other streams."""
        try:
            self.protocol.send(BATCH, stream_id, batch)
        except Exception:
            logger.exception("%s: stream %s: a chunk cannot be sent", self._server.label, stream_id)
            failed = error_entry(PenstockError("Internal server error"))
            self.protocol.send(BATCH, stream_id, [failed])
            return False
        return True

    def _on_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        for stream in list(self._streams.values()):
            if stream.task is not None:
                stream.task.cancel()
