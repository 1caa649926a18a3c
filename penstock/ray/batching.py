"""The replica's end of the data plane: every stream's chunks sent to the ingress in batches.

Each replica listens on one TCP port (:class:`StreamServer`, its address in the replica's
status); the ingress holds one connection to it that carries every stream between them
(the frames of :mod:`penstock.ray.wire`), so no per-message Ray machinery is on the token
path. Each request's engine runs on from the moment it arrives (:class:`ChunkBatcher`
fills the request's list of chunks); the connection sends one frame at a time, at most one
per ``FRAME_INTERVAL_S``, carrying every chunk each stream produced since the last one,
as far as each stream's credit allows, and the ends of the streams that finished. A
:class:`~penstock.errors.PenstockError` ends the stream as its last entry
(:func:`penstock.ray.wire.error_entry`); the ingress (:mod:`penstock.ray.streams`) raises
it again.

A cancelled stream (the ingress's client left), or a lost connection (the ingress went
away), closes the stream's chunks here: the replica's host kills the request's context
and aborts it once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from penstock.errors import PenstockError
from penstock.ray.wire import (
    BATCH,
    CANCEL,
    CREDIT,
    HELLO,
    OPEN,
    WINDOW,
    FrameProtocol,
    error_entry,
)

logger = logging.getLogger(__name__)

_INTERNAL = "Internal server error"
# At most one frame per connection this often: a chunk after a quiet spell leaves on the
# next turn of the loop, while a busy replica gathers what its engines yield meanwhile
# into one frame (0.5 ms: ~15 chunks per stream batch at full speed, against ~2 when each
# turn sent one; each frame and each batch costs both ends).
FRAME_INTERVAL_S = 0.0005
# A connection that has not shown the fleet's token by then is closed: a peer of the fleet
# sends it first thing.
HELLO_TIMEOUT_S = 10.0


class ChunkBatcher:
    """Runs ``chunks`` into a list from construction on; :meth:`take` empties it.

    ``on_ready`` is called when the list gains its first chunk since the last
    :meth:`take`, and when the chunks end.
    """

    def __init__(
        self, chunks: AsyncIterator[dict[str, Any]], label: str, on_ready: Callable[[], None]
    ) -> None:
        self.ended = False
        self._label = label
        self._chunks: list[dict[str, Any]] = []
        self._on_ready = on_ready
        self._pump = asyncio.get_running_loop().create_task(self._run(chunks))

    @property
    def has_chunks(self) -> bool:
        return bool(self._chunks)

    def take(self) -> list[dict[str, Any]]:
        """Every chunk produced since the last call (an error entry last once it failed)."""
        chunks, self._chunks = self._chunks, []
        return chunks

    def cancel(self) -> None:
        """Stop the chunks' source if it still runs (cancelling the engine request)."""
        self._pump.cancel()

    async def _run(self, chunks: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for chunk in chunks:
                queued = self._chunks
                queued.append(chunk)
                if len(queued) == 1:
                    self._on_ready()
        except PenstockError as exc:
            self._chunks.append(error_entry(exc))
        except Exception:
            logger.exception("%s failed", self._label)
            self._chunks.append(error_entry(PenstockError(_INTERNAL)))
        self.ended = True
        self._on_ready()


# Opens a request's chunks: (request id, request, LoRA adapter or None).
StreamSource = Callable[[str, dict[str, Any], tuple[str, str] | None], AsyncIterator[dict]]


class StreamServer:
    """The replica's data plane port: serves each connection's streams from ``source``.

    A connection must open with the fleet's token (within ``hello_timeout_s``) before
    anything else it sends is read beyond a short frame (:class:`FrameProtocol`'s limits).
    """

    def __init__(
        self,
        source: StreamSource,
        token: str,
        label: str,
        *,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
    ) -> None:
        self.source = source
        self.token = token
        self.label = label
        self.hello_timeout_s = hello_timeout_s
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
    __slots__ = ("batcher", "credit")

    def __init__(self) -> None:
        self.credit = WINDOW
        self.batcher: ChunkBatcher


class _ReplicaConnection:
    """One ingress's connection: its streams, sent together a frame at a time."""

    def __init__(self, server: StreamServer) -> None:
        self._server = server
        self.protocol = FrameProtocol(
            self._on_frame, self._on_lost, trusted=False, on_writable=self._schedule
        )
        self._greeted = False
        self._streams: dict[int, _Stream] = {}
        # The streams with chunks (or their end) to send, in the order they became so.
        self._ready: dict[int, _Stream] = {}
        self._scheduled = False
        self._last_flush = 0.0
        self._hello_timer = asyncio.get_running_loop().call_later(
            server.hello_timeout_s, self._refuse_silent
        )

    def _refuse_silent(self) -> None:
        if not self._greeted:
            logger.warning("%s: closed a data connection that sent no token", self._label)
            self.protocol.close()

    def _on_frame(self, frame: list[Any]) -> None:
        kind = frame[0]
        if not self._greeted:
            # Only an ingress of this fleet (it holds the token) may open streams.
            self._greeted = kind == HELLO and hmac.compare_digest(str(frame[1]), self._server.token)
            if self._greeted:
                self._hello_timer.cancel()
                self.protocol.trust()
            else:
                logger.warning("%s: refused a data connection without the token", self._label)
                self.protocol.close()
        elif kind == OPEN:
            self._open(*frame[1:5])
        elif kind == CREDIT:
            credits = frame[1]
            for i in range(0, len(credits), 2):
                if (stream := self._streams.get(credits[i])) is not None:
                    stream.credit += int(credits[i + 1])
                    if stream.batcher.has_chunks:
                        self._ready_now(credits[i], stream)
        elif kind == CANCEL and (stream := self._streams.pop(frame[1], None)) is not None:
            self._ready.pop(frame[1], None)
            stream.batcher.cancel()

    @property
    def _label(self) -> str:
        return self._server.label

    def _open(self, stream_id: int, request_id: str, request: dict, adapter: Any) -> None:
        stream = self._streams[stream_id] = _Stream()
        chunks = self._server.source(request_id, request, tuple(adapter) if adapter else None)
        stream.batcher = ChunkBatcher(
            chunks, f"{self._label}: stream {stream_id}", lambda: self._ready_now(stream_id, stream)
        )

    def _ready_now(self, stream_id: int, stream: _Stream) -> None:
        # A stream cancelled meanwhile has nothing more to send.
        if self._streams.get(stream_id) is stream:
            self._ready[stream_id] = stream
            self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._ready:
            self._scheduled = True
            loop = asyncio.get_running_loop()
            wait = self._last_flush + FRAME_INTERVAL_S - loop.time()
            if wait > 0:
                loop.call_later(wait, self._flush)
            else:
                loop.call_soon(self._flush)

    def _flush(self) -> None:
        """One frame: each ready stream's chunks, as far as its credit allows, and the ends
        of the streams that finished. Waits while the socket's send buffer is full (the
        ingress reads slower); the engines run on meanwhile."""
        self._scheduled = False
        if self.protocol.closed or not self.protocol.writable:
            return
        self._last_flush = asyncio.get_running_loop().time()
        batches: list[Any] = []
        ended: list[int] = []
        for stream_id, stream in list(self._ready.items()):
            batcher = stream.batcher
            if batcher.has_chunks:
                if stream.credit <= 0:
                    continue
                stream.credit -= 1
                batches += (stream_id, batcher.take())
            del self._ready[stream_id]
            if batcher.ended:
                ended.append(stream_id)
                del self._streams[stream_id]
        if batches or ended:
            try:
                self.protocol.send_now(BATCH, batches, ended)
            except Exception:
                self._send_each(batches, ended)

    def _send_each(self, batches: list[Any], ended: list[int]) -> None:
        """Send a frame that cannot be encoded stream by stream: a chunk that cannot be
        encoded ends its own stream with an error, not the connection's other streams."""
        for i in range(0, len(batches), 2):
            stream_id, chunks = batches[i], batches[i + 1]
            end = [stream_id] if stream_id in ended else []
            try:
                self.protocol.send_now(BATCH, [stream_id, chunks], end)
            except Exception:
                logger.exception("%s: stream %s: a chunk cannot be sent", self._label, stream_id)
                failed = [stream_id, [error_entry(PenstockError(_INTERNAL))]]
                self.protocol.send_now(BATCH, failed, [stream_id])
                if (stream := self._streams.pop(stream_id, None)) is not None:
                    self._ready.pop(stream_id, None)
                    stream.batcher.cancel()
        sent = set(batches[::2])
        if rest := [stream_id for stream_id in ended if stream_id not in sent]:
            self.protocol.send_now(BATCH, [], rest)

    def _on_lost(self, exc: Exception | None) -> None:
        self._hello_timer.cancel()
        self._server.connections.discard(self)
        self._ready.clear()
        for stream in self._streams.values():
            stream.batcher.cancel()
        self._streams.clear()
