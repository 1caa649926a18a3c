"""A lean server-sent-events response with disconnect detection and keep-alive comments.

Frames arrive pre-encoded (``b"data: ...\\n\\n"``) so nothing is re-serialized here. A
client disconnect cancels the producer at once, which is what stops the engine's work.

The response start goes through every middleware; the body frames go straight to the
server's own ``send`` when the outermost app left it in the scope under
:data:`WIRE_SEND_KEY` (every middleware of the stack acts on the start only, and a
chain of ~8 wrappers per frame was a quarter of the gateway's cost per streamed token).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE_FRAME = b"data: [DONE]\n\n"
# Where the outermost ASGI app leaves the server's ``send`` for the frames of a stream.
WIRE_SEND_KEY = "penstock.wire_send"
KEEPALIVE_FRAME = b": keep-alive\n\n"


def data_frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        send = scope.get(WIRE_SEND_KEY, send)
        last_sent = time.monotonic()

        async def produce() -> None:
            nonlocal last_sent
            async for frame in self.frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                last_sent = time.monotonic()

        async def keepalive() -> None:
            nonlocal last_sent
            while True:
                await asyncio.sleep(max(self.keepalive_s - (time.monotonic() - last_sent), 0.01))
                if time.monotonic() - last_sent >= self.keepalive_s:
                    await send(
                        {"type": "http.response.body", "body": KEEPALIVE_FRAME, "more_body": True}
                    )
                    last_sent = time.monotonic()

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(watch_disconnect())
        pinger = asyncio.ensure_future(keepalive()) if self.keepalive_s > 0 else None
        try:
            done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            tasks = [t for t in (producer, watcher, pinger) if t is not None]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
        if producer not in done:
            self.disconnected = True
            return
        error = producer.exception()
        if error is not None:
            raise error
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
