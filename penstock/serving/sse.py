"""A lean server-sent-events response with disconnect detection and keep-alive comments.

Frames arrive pre-encoded (``b"data: ...\\n\\n"``) so nothing is re-serialized here. A
client disconnect cancels the producer at once, which is what stops the engine's work.

The response start goes through every middleware; the body frames go straight to the
server's own ``send`` when the outermost app left it in the scope under
:data:`WIRE_SEND_KEY` (every middleware of the stack acts on the start only, and a
chain of ~8 wrappers per frame was a quarter of the gateway's cost per streamed token).
Where the server's HTTP protocol offers a :class:`FrameWriter` (:data:`FRAME_WRITER_KEY`),
a frame the connection can take at once is written by it, with no ASGI message at all;
the others (flow control paused, the connection gone) take the ``send`` path. The
opening frames (at hand when the response is made) leave with the response start, held
by the writer for them: one write to the connection, not two, before the first token.

One task per stream, the request's own: it pulls each frame and writes it. The server's
HTTP protocol leaves a :class:`DisconnectSignal` in the scope (:data:`DISCONNECT_KEY`)
and fires it when the connection is lost, which cancels the writer if it is waiting for
the next frame. Keep-alive comments come from one timer for all the open streams of a
loop (:class:`_KeepAlive`), which sends one (in a short task of its own) to a stream that
has been quiet for ``keepalive_s``. ``DONE_FRAME`` goes out as the last message of the
body (one write, not two). Without the signal (an in-process client), a second task
blocks on ``receive`` to notice the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from penstock.schemas.fields import ignored_fields_header

DONE_FRAME = b"data: [DONE]\n\n"
# Where the outermost ASGI app leaves the server's ``send`` for the frames of a stream.
WIRE_SEND_KEY = "penstock.wire_send"
# Where the server's HTTP protocol leaves the request's :class:`DisconnectSignal`.
DISCONNECT_KEY = "penstock.disconnect"
# Where the server's HTTP protocol leaves the request's :class:`FrameWriter`.
FRAME_WRITER_KEY = "penstock.frame_writer"
KEEPALIVE_FRAME = b": keep-alive\n\n"
# How often, per keep-alive interval, the open streams are checked for one.
_CHECKS_PER_INTERVAL = 4


def data_frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class FrameWriter(Protocol):
    """Writes body frames of a started response straight to its connection."""

    def hold_start(self) -> None:
        """Keep the response start, about to be sent, until the body's next bytes, to
        write them together: for a response whose body follows its start at once."""
        ...

    def write(self, frame: bytes) -> bool:
        """Write ``frame`` (not empty, not the body's last) now and return True, or write
        nothing and return False when it must go as an ``http.response.body`` message:
        the connection asked the writer to wait, is gone, or the response is not one this
        writer frames."""
        ...


class DisconnectSignal:
    """That the client's connection was lost before its response ended.

    The server's HTTP protocol fires it; whoever answers the request may :meth:`watch` it
    with a callback instead of keeping a task blocked on ``receive``.
    """

    __slots__ = ("_callback", "lost")

    def __init__(self) -> None:
        self.lost = False
        self._callback: Callable[[], None] | None = None

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the connection is lost (None: stop watching)."""
        self._callback = callback

    def fire(self) -> None:
        if self.lost:
            return
        self.lost = True
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()


async def watch_receive(receive: Receive, signal: DisconnectSignal) -> None:
    """Fire ``signal`` when ``receive`` says the client went away."""
    while (await receive())["type"] != "http.disconnect":
        continue
    signal.fire()


def disconnect_signal(scope: Scope, receive: Receive) -> tuple[DisconnectSignal, Any]:
    """The request's signal, and the watcher task to cancel when done (None when the
    server provides the signal)."""
    signal = scope.get(DISCONNECT_KEY)
    if signal is not None:
        return signal, None
    signal = DisconnectSignal()
    return signal, asyncio.ensure_future(watch_receive(receive, signal))


class EventStreamResponse(Response):
    """Response streaming ``frames`` as ``text/event-stream``."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        *,
        opening: bytes = b"",
        keepalive_s: float = 15.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.frames = frames
        # The body's first frames, at hand already: they leave with the response start.
        self.opening = opening
        self.keepalive_s = keepalive_s
        self.extra_headers = dict(headers or {})
        self.status_code = 200
        self.background = None
        self.disconnected = False
        # Whether the frames ended with ``DONE_FRAME``, then sent as the body's last message.
        self.completed = False
        # Loop time of the last frame or comment written, read by the keep-alive check.
        self.last_sent = 0.0
        self._send: Send | None = None
        self._task: asyncio.Task[Any] | None = None
        # Whether the writer waits for the next frame: only then may a disconnect cancel it.
        self._waiting = False
        self._ping: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        ignored = ignored_fields_header()
        if ignored is not None:
            raw_headers.append(ignored)
        writer: FrameWriter | None = scope.get(FRAME_WRITER_KEY)
        opening, self.opening = self.opening, b""
        if opening and writer is not None:
            writer.hold_start()
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        send = self._send = scope.get(WIRE_SEND_KEY, send)
        write = writer.write if writer is not None else None
        if opening and (write is None or not write(opening)):
            await send({"type": "http.response.body", "body": opening, "more_body": True})
        signal, watcher = disconnect_signal(scope, receive)
        loop = asyncio.get_running_loop()
        task = self._task = asyncio.current_task()
        assert task is not None
        next_frame = self.frames.__anext__
        keepalive_s = self.keepalive_s
        self.last_sent = loop.time()
        signal.watch(self._gone)
        self.disconnected = signal.lost
        if keepalive_s > 0:
            _KeepAlive.join(self, keepalive_s)
        try:
            while not self.disconnected:
                self._waiting = True
                try:
                    frame = await next_frame()
                except StopAsyncIteration:
                    break
                finally:
                    self._waiting = False
                if frame is DONE_FRAME:
                    # Sent as the body's last message, once the keep-alive is stopped.
                    self.completed = True
                    break
                if write is None or not write(frame):
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                self.last_sent = loop.time()
        except asyncio.CancelledError:
            # Ours (the client left) ends the response quietly; any other goes on.
            if not self.disconnected or task.uncancel() > 0:
                raise
        finally:
            await self._stop(signal, watcher)
        if self.disconnected:
            return
        last = DONE_FRAME if self.completed else b""
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _stop(self, signal: DisconnectSignal, watcher: asyncio.Future[None] | None) -> None:
        """Stop what the stream started: the disconnect watch, the keep-alive, a comment
        still being written, the producer (when stopped before its end) and the watcher."""
        signal.watch(None)
        if self.keepalive_s > 0:
            _KeepAlive.leave(self, self.keepalive_s)
        ping, self._ping = self._ping, None
        if ping is not None:
            ping.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await ping
        if self.disconnected or self.completed:
            # Stopped before the producer's end: it must still end the engine's work.
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:
                await aclose()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    def ping(self, now: float) -> None:
        """Send a keep-alive comment (in a short task: the check that calls this is a
        timer) unless the previous one is still being written."""
        self.last_sent = now
        ping, send = self._ping, self._send
        if send is not None and (ping is None or ping.done()):
            message = {"type": "http.response.body", "body": KEEPALIVE_FRAME, "more_body": True}
            # Starlette types ``send`` as returning an awaitable; the server's is a coroutine.
            self._ping = asyncio.get_running_loop().create_task(send(message))  # type: ignore[arg-type]

    def _gone(self) -> None:
        self.disconnected = True
        if self._waiting and self._task is not None:
            self._task.cancel()


# The keep-alive timer of each loop and interval with streams open.
_KEEPALIVES: dict[tuple[asyncio.AbstractEventLoop, float], _KeepAlive] = {}


class _KeepAlive:
    """The keep-alive comments of every open stream of one loop and interval: one timer
    for all of them, checking every stream ``_CHECKS_PER_INTERVAL`` times an interval (a
    timer of each stream's own, with its closures and context, was ~0.9 kB a stream).

    A stream quiet for ``interval`` gets a comment at its next check, so within
    ``interval * (1 + 1 / _CHECKS_PER_INTERVAL)`` of its last frame.
    """

    __slots__ = ("interval", "loop", "streams", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self.loop = loop
        self.interval = interval
        self.streams: set[EventStreamResponse] = set()
        self.timer = loop.call_later(interval / _CHECKS_PER_INTERVAL, self._check)

    @classmethod
    def join(cls, stream: EventStreamResponse, interval: float) -> None:
        loop = asyncio.get_running_loop()
        keepalive = _KEEPALIVES.get((loop, interval))
        if keepalive is None:
            keepalive = _KEEPALIVES[(loop, interval)] = cls(loop, interval)
        keepalive.streams.add(stream)

    @staticmethod
    def leave(stream: EventStreamResponse, interval: float) -> None:
        key = (asyncio.get_running_loop(), interval)
        keepalive = _KEEPALIVES.get(key)
        if keepalive is None:
            return
        keepalive.streams.discard(stream)
        if not keepalive.streams:
            # No timer outlives the last stream: nothing keeps the loop or this entry.
            keepalive.timer.cancel()
            del _KEEPALIVES[key]

    def _check(self) -> None:
        now = self.loop.time()
        for stream in self.streams:
            if now - stream.last_sent >= self.interval:
                stream.ping(now)
        self.timer = self.loop.call_later(self.interval / _CHECKS_PER_INTERVAL, self._check)
