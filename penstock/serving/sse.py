"""A lean server-sent-events response with disconnect detection and keep-alive comments.

Frames arrive pre-encoded (``b"data: ...\\n\\n"``) so nothing is re-serialized here. A
client disconnect cancels the producer at once, which is what stops the engine's work.

The response start goes through every middleware; the body frames go straight to the
server's own ``send`` when the outermost app left it in the scope under
:data:`WIRE_SEND_KEY` (every middleware of the stack acts on the start only, and a
chain of ~8 wrappers per frame was a quarter of the gateway's cost per streamed token).

One task per stream, the request's own: it pulls each frame and writes it. The server's
HTTP protocol leaves a :class:`DisconnectSignal` in the scope (:data:`DISCONNECT_KEY`)
and fires it when the connection is lost, which cancels the writer if it is waiting for
the next frame; keep-alive comments come from a timer that sends one (in a short task of
its own) only after ``keepalive_s`` without a frame. ``DONE_FRAME`` goes out as the last
message of the body (one write, not two). Without the signal (an in-process
client), a second task blocks on ``receive`` to notice the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE_FRAME = b"data: [DONE]\n\n"
# Where the outermost ASGI app leaves the server's ``send`` for the frames of a stream.
WIRE_SEND_KEY = "penstock.wire_send"
# Where the server's HTTP protocol leaves the request's :class:`DisconnectSignal`.
DISCONNECT_KEY = "penstock.disconnect"
KEEPALIVE_FRAME = b": keep-alive\n\n"


def data_frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


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
        keepalive_s: float = 15.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.frames = frames
        self.keepalive_s = keepalive_s
        self.extra_headers = dict(headers or {})
        self.status_code = 200
        self.background = None
        self.disconnected = False
        # Whether the frames ended with ``DONE_FRAME``, then sent as the body's last message.
        self.completed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        send = scope.get(WIRE_SEND_KEY, send)
        signal, watcher = disconnect_signal(scope, receive)
        try:
            await self._write(send, signal)
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        if self.disconnected:
            return
        last = DONE_FRAME if self.completed else b""
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _write(self, send: Send, signal: DisconnectSignal) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        next_frame = self.frames.__anext__
        keepalive_s = self.keepalive_s
        waiting = False
        last_sent = loop.time()
        timer: asyncio.TimerHandle | None = None
        ping: asyncio.Task[None] | None = None

        def gone() -> None:
            self.disconnected = True
            if waiting:
                task.cancel()

        def keepalive() -> None:
            nonlocal last_sent, timer, ping
            now = loop.time()
            if now - last_sent >= keepalive_s:
                last_sent = now
                if ping is None or ping.done():
                    message = {"type": "http.response.body", "body": KEEPALIVE_FRAME}
                    message["more_body"] = True
                    ping = loop.create_task(send(message))
            timer = loop.call_at(last_sent + keepalive_s, keepalive)

        signal.watch(gone)
        self.disconnected = signal.lost
        if keepalive_s > 0:
            timer = loop.call_at(last_sent + keepalive_s, keepalive)
        try:
            while not self.disconnected:
                waiting = True
                try:
                    frame = await next_frame()
                except StopAsyncIteration:
                    return
                finally:
                    waiting = False
                if frame is DONE_FRAME:
                    # Sent as the body's last message, once the keep-alive is stopped.
                    self.completed = True
                    return
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                last_sent = loop.time()
        except asyncio.CancelledError:
            # Ours (the client left) ends the response quietly; any other goes on.
            if not self.disconnected or task.uncancel() > 0:
                raise
        finally:
            signal.watch(None)
            if timer is not None:
                timer.cancel()
            if ping is not None:
                ping.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await ping
            if self.disconnected or self.completed:
                # Stopped before the producer's end: it must still end the engine's work.
                aclose = getattr(self.frames, "aclose", None)
                if aclose is not None:
                    await aclose()
