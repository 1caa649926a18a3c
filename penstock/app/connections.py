"""Connection hygiene uvicorn lacks: header and body read timeouts, a bound on the request
head, a connection limit, HTTP/1.0 streams, and the process's open-file limit.

uvicorn holds a connection that never finishes its request headers for ever, so a few
hundred idle sockets exhaust the process's file descriptors and normal requests fail with
EMFILE. :class:`GuardedHttpProtocol` (uvicorn's httptools protocol with timers) closes
them:

* header timeout: from the connection's start (or the first byte of a later request on a
  kept-alive connection) to the end of the request headers. A client that sent part of a
  request gets a 408 envelope, one that sent nothing is closed silently;
* body timeout: the longest pause between two pieces of a request body, and body deadline:
  the longest a whole body may take after its headers, however steadily it trickles. While
  reading is paused because the app has not consumed what arrived, the client is not to
  blame and the timers wait. A response not yet begun becomes a 408 envelope;
* head size: a request line and headers over :data:`MAX_HEAD_BYTES` get a 431 envelope
  and the connection is closed, before more of them is buffered;
* HTTP/1.0: it has no chunked encoding, so a response with no ``Content-Length`` (an event
  stream) is sent as is and ended by closing the connection (:class:`CloseDelimitedCycle`);
* disconnects: each request's scope holds a
  :class:`~penstock.serving.sse.DisconnectSignal`, fired when its connection is lost
  before the response ended, so responses notice without a task blocked on ``receive``;
* frames: each request's scope holds a :class:`ChunkedFrameWriter`
  (:class:`~penstock.serving.sse.FrameWriter`), which writes an event stream's frames as
  HTTP chunks straight to the transport, byte for byte what uvicorn's ``send`` writes for
  them, without its checks and message handling for each frame, and can hold a response
  start for the bytes that follow it (one write where uvicorn makes two);
* connection limit: a request that arrives while more than ``max_connections``
  connections are open gets a 503 envelope (``too_many_connections``) and its connection
  is closed, so clients see why; the header timeout bounds how long the surplus stays.

Keep-alive idle connections are closed by uvicorn's own ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
import weakref
from http import HTTPStatus
from typing import Any, ClassVar

import orjson
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from penstock.app.middleware import ANSWERED_STATUS_KEY
from penstock.errors import (
    HeadersTooLargeError,
    PenstockError,
    ServiceUnavailableError,
    SlowClientError,
)
from penstock.serving.sse import DISCONNECT_KEY, FRAME_WRITER_KEY, DisconnectSignal

logger = logging.getLogger(__name__)

# Files the process needs besides its connections (engine weights, logs, the job db).
_FD_RESERVE = 256
_LIMIT_WARNING_INTERVAL_S = 10.0
# The longest request line and headers read, in bytes, as common servers bound them.
MAX_HEAD_BYTES = 64 * 1024
# How long a refused connection stays open for the client to read its answer.
LINGER_S = 2.0


class ConnectionLimits:
    """The timeouts (seconds, 0 = off) and the connection limit (0 = none) of one server."""

    __slots__ = (
        "body_deadline_s",
        "body_timeout_s",
        "header_timeout_s",
        "last_limit_warning",
        "max_connections",
    )

    def __init__(
        self,
        header_timeout_s: float,
        body_timeout_s: float,
        max_connections: int,
        body_deadline_s: float = 0.0,
    ):
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.body_deadline_s = body_deadline_s
        self.max_connections = max_connections
        self.last_limit_warning = -_LIMIT_WARNING_INTERVAL_S


def _raw_response(error: PenstockError) -> bytes:
    body = orjson.dumps(error.envelope())
    head = (
        f"HTTP/1.1 {error.status_code} {HTTPStatus(error.status_code).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _refusal(error: PenstockError) -> Any:
    """An app answering ``error`` and closing the connection, for a request the protocol
    refuses once its headers are in."""
    body = orjson.dumps(error.envelope())

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        start = {"type": "http.response.start", "status": error.status_code, "headers": headers}
        await send(start)
        await send({"type": "http.response.body", "body": body})

    return refuse


def _too_many_connections(limit: int) -> PenstockError:
    return ServiceUnavailableError(
        f"Too many open connections (the limit is {limit}); retry later",
        code="too_many_connections",
    )


def _head_error() -> PenstockError:
    return HeadersTooLargeError(
        f"Request line and headers are over {MAX_HEAD_BYTES // 1024} KiB",
    )


class CloseDelimitedCycle(RequestResponseCycle):
    """An HTTP/1.0 request's cycle. A response that gives no ``Content-Length`` (nor a
    ``Transfer-Encoding`` of its own) is not chunked, which HTTP/1.0 clients cannot read:
    its body is written as is and the connection's close ends it."""

    close_delimited = False

    async def send(self, message: Any) -> None:
        if not self.response_started:
            if message["type"] == "http.response.start" and self._unframed(message):
                self.close_delimited = True
                # uvicorn adds ``Transfer-Encoding: chunked`` only while this is None.
                self.chunked_encoding = False
        elif self.close_delimited and message["type"] == "http.response.body":
            await self._send_body(message)
            return
        await super().send(message)

    def _unframed(self, message: Any) -> bool:
        if self.scope["method"] == "HEAD" or message["status"] in (204, 304):
            return False
        names = {name.lower() for name, _ in message.get("headers", ())}
        return not names & {b"content-length", b"transfer-encoding"}

    async def _send_body(self, message: Any) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected or self.response_complete:
            return
        self.transport.write(message.get("body", b""))
        if not message.get("more_body", False):
            self.response_complete = True
            self.message_event.set()
            self.transport.close()
            self.on_response()


class _StartHeld:
    """Stands in for a cycle's transport from a response start to the next write: the
    start's bytes (the status line and headers, which uvicorn writes at once) leave with
    the body's first bytes, in one write. It gives the cycle its transport back then."""

    __slots__ = ("_cycle", "start", "transport")

    def __init__(self, cycle: RequestResponseCycle, transport: asyncio.Transport) -> None:
        # Weak, as the cycle holds this in its place until the next write.
        self._cycle = weakref.ref(cycle)
        self.transport = transport
        self.start: bytes | None = None

    def write(self, data: bytes) -> None:
        if self.start is None:
            self.start = data
            return
        self._release()
        self.transport.write(self.start + data)

    def close(self) -> None:
        self._release()
        if self.start is not None:
            self.transport.write(self.start)
        self.transport.close()

    def _release(self) -> None:
        cycle = self._cycle()
        if cycle is not None:
            cycle.transport = self.transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class ChunkedFrameWriter:
    """One request's :class:`~penstock.serving.sse.FrameWriter` over uvicorn's cycle.

    It holds the cycle weakly: the cycle holds the scope that holds this writer, and a
    strong reference would leave every request's cycle and scope to the garbage
    collector instead of freeing them when the request ends."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    @property
    def cycle(self) -> RequestResponseCycle | None:
        return self._cycle()

    def hold_start(self) -> None:
        cycle = self._cycle()
        # A HEAD response writes no body: nothing would carry its start.
        if cycle is None or cycle.response_started or cycle.scope["method"] == "HEAD":
            return
        cycle.transport = _StartHeld(cycle, cycle.transport)  # type: ignore[assignment]

    def write(self, frame: bytes) -> bool:
        cycle = self._cycle()
        # uvicorn's ``send`` waits for the drain first, writes nothing once disconnected,
        # and frames a body in chunks only when the response chose chunked encoding.
        if (
            cycle is None
            or cycle.flow.write_paused
            or cycle.disconnected
            or cycle.response_complete
        ):
            return False
        if cycle.chunked_encoding:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(frame), frame))
        elif type(cycle) is CloseDelimitedCycle and cycle.close_delimited:
            cycle.transport.write(frame)
        else:
            return False
        return True


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the timeouts and limit of :class:`ConnectionLimits`.

    Use :func:`guarded_protocol` to get a subclass bound to one server's limits.
    """

    # Slots keep these out of the instance dict: uvicorn's own attributes fill a dict that
    # shares its keys with every other connection's, and four more would unshare it
    # (about 1.5 kB more per connection).
    __slots__ = (
        "_body_deadline",
        "_body_started",
        "_body_timer",
        "_head_bytes",
        "_head_in_reads",
        "_head_offset",
        "_header_timer",
        "_in_body",
        "_in_headers",
        "_lingering",
        "_read_body_bytes",
        "_read_bytes",
    )

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        # When the current request's headers ended, on the loop's clock.
        self._body_started = 0.0
        # The bytes of a request head that one read left unfinished (the parser keeps an
        # unfinished header to itself): what it took of that read, then every byte of the
        # reads after it, while it stays unfinished (see MAX_HEAD_BYTES).
        self._head_bytes = 0
        self._head_in_reads = False
        # The current read's size, its body bytes, and how many of those came before the
        # head that began in it.
        self._read_bytes = 0
        self._read_body_bytes = 0
        self._head_offset = 0
        # Between the first byte of a request and the end of its headers.
        self._in_headers = False
        # Between the end of a request's headers and the end of its body.
        self._in_body = False
        # After a refusal: what the client still sends is read and dropped until it closes.
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timers()
        super().connection_lost(exc)
        self._fire_disconnect()

    def _fire_disconnect(self) -> None:
        """Tell the response of a request cut off before its end (see
        :class:`~penstock.serving.sse.DisconnectSignal`)."""
        cycle = self.cycle
        if cycle is not None and cycle.disconnected:
            signal = cycle.scope.get(DISCONNECT_KEY)
            if signal is not None:
                signal.fire()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        self._read_bytes = len(data)
        self._read_body_bytes = 0
        # Cleared by a head beginning in this read.
        self._head_in_reads = self._in_headers
        super().data_received(data)
        # Timers are armed only for what this read left unfinished, so a request that
        # arrives whole costs no timer at all.
        if self._lingering or self.transport.is_closing():
            return
        if self._in_headers:
            if self._head_in_reads:
                self._head_bytes += len(data)
            else:
                # Pipelined requests before it in the read are counted in too, all but
                # their bodies: heads are small, or refused.
                self._head_bytes = len(data) - self._head_offset
                self._head_in_reads = True
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()
                return
            if self._header_timer is None:
                self._arm_header_timer()
        if self._in_body:
            self._arm_body_timer()
            if self._body_deadline is None and self.limits.body_deadline_s > 0:
                self._body_deadline = self.loop.call_at(
                    self._body_started + self.limits.body_deadline_s, self._body_overdue
                )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._head_bytes = 0
        self._head_in_reads = False
        self._head_offset = self._read_body_bytes

    def on_body(self, body: bytes) -> None:
        self._read_body_bytes += len(body)
        # The base class named, not ``super()``: no proxy object for each piece of a body.
        HttpToolsProtocol.on_body(self, body)

    def _refuse_head(self) -> None:
        """Answer a head still growing past the bound, without reading the rest."""
        self._cancel_header_timer()
        self._in_headers = False
        self.transport.write(_raw_response(_head_error()))
        self._close_after_refusal()

    def on_headers_complete(self) -> None:
        # Before uvicorn builds the request's cycle around this scope.
        self.scope[DISCONNECT_KEY] = DisconnectSignal()  # type: ignore[typeddict-unknown-key]
        self._cancel_header_timer()
        self._in_headers = False
        self._in_body = True
        self._body_started = self.loop.time()
        limit = self.limits.max_connections
        # Begun and ended within a read no larger than the bound: most heads stop at this
        # test, without the call.
        if (self._head_in_reads or self._read_bytes > MAX_HEAD_BYTES) and self._head_over_bound():
            self._run_instead(_head_error())
        elif limit and len(self.connections) > limit:
            self._warn_limit(limit)
            self._run_instead(_too_many_connections(limit))
        else:
            super().on_headers_complete()
        cycle = self.cycle
        # No cycle of its own for a request uvicorn hands to its websocket upgrade.
        if cycle is not None and cycle.scope is self.scope:
            if self.scope["http_version"] == "1.0":
                # Before its task first runs, which looks up the cycle's ``send``.
                cycle.__class__ = CloseDelimitedCycle
            self.scope[FRAME_WRITER_KEY] = ChunkedFrameWriter(cycle)  # type: ignore[typeddict-unknown-key]

    def _head_over_bound(self) -> bool:
        """Whether the head whose end was just parsed is over MAX_HEAD_BYTES."""
        # With each header's ": " and line end.
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        return size > MAX_HEAD_BYTES

    def _run_instead(self, error: PenstockError) -> None:
        """Build the request's cycle as uvicorn does, around an app answering ``error``."""
        # uvicorn reads the app to run from ``self.app`` while it builds the cycle.
        app = self.app
        self.app = _refusal(error)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._in_body = False
        # A body that arrived with its head armed no timer.
        if self._body_timer is not None or self._body_deadline is not None:
            self._cancel_body_timers()
        super().on_message_complete()
        # uvicorn stops reading while it holds more than its high-water mark of a body and
        # reads on only when the app next asks for the body: an app that has the whole body
        # never asks again, so a client that left before its answer went unseen and its
        # request ran to the end. What follows a whole body is the client's close, or a
        # next request, which uvicorn queues and stops reading for itself.
        if not self.pipeline:
            self.flow.resume_reading()

    def _warn_limit(self, limit: int) -> None:
        now = time.monotonic()
        if now - self.limits.last_limit_warning >= _LIMIT_WARNING_INTERVAL_S:
            self.limits.last_limit_warning = now
            logger.warning(
                "connection limit reached (%d open, limit %d): answering 503",
                len(self.connections),
                limit,
            )

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if self.limits.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(
                self.limits.header_timeout_s, self._header_timed_out
            )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _arm_body_timer(self) -> None:
        self._cancel_body_timer()
        if self.limits.body_timeout_s > 0:
            self._body_timer = self.loop.call_later(
                self.limits.body_timeout_s, self._body_timed_out
            )

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_body_timers(self) -> None:
        self._cancel_body_timer()
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._in_headers:
            error = SlowClientError(
                f"Request headers not received within {self.limits.header_timeout_s:g}s",
                code="header_timeout",
            )
            self.transport.write(_raw_response(error))
        self._close_after_refusal()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:
            self._arm_body_timer()
            return
        self._refuse_slow_body(
            SlowClientError(
                f"Request body stalled for {self.limits.body_timeout_s:g}s",
                code="body_timeout",
            )
        )

    def _body_overdue(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:
            # The server holds the rest back, not the client: checked again a body
            # timeout later.
            self._body_deadline = self.loop.call_later(
                self.limits.body_timeout_s or self.limits.body_deadline_s, self._body_overdue
            )
            return
        self._refuse_slow_body(
            SlowClientError(
                f"Request body not received within {self.limits.body_deadline_s:g}s of its headers",
                code="body_deadline",
            )
        )

    def _refuse_slow_body(self, error: SlowClientError) -> None:
        self._cancel_body_timers()
        cycle = self.cycle
        started = cycle is not None and cycle.response_started
        if cycle is not None:
            # The app's receive answers a disconnect and its sends are dropped from here on.
            cycle.disconnected = True
            cycle.message_event.set()
            self._fire_disconnect()
        if not started:
            self.transport.write(_raw_response(error))
            if cycle is not None:
                cycle.scope.setdefault("state", {})[ANSWERED_STATUS_KEY] = error.status_code
        self._close_after_refusal()

    def _close_after_refusal(self) -> None:
        """Close once the client could read the refusal. Closing with the client's unread
        bytes in the socket resets the connection, and a reset can drop the answer before
        the client reads it: the write side is shut first, what arrives is dropped, and
        the connection closes when the client closes it or after :data:`LINGER_S`."""
        if self._lingering or self.transport.is_closing():
            return
        self._lingering = True
        self._cancel_header_timer()
        self._cancel_body_timers()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
    """A :class:`GuardedHttpProtocol` bound to ``limits``, for ``uvicorn.Config(http=...)``."""
    return type("BoundGuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


def raise_open_file_limit(max_connections: int) -> None:
    """Raise the soft RLIMIT_NOFILE to the hard one, as servers commonly do, and warn when
    the connection limit would still run into it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft != infinite and (hard == infinite or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            logger.debug("the open-file limit stays %d: %s", soft, exc)
        else:
            logger.debug("raised the open-file limit from %d to %d", soft, hard)
            soft = hard
    if soft != infinite and max_connections and max_connections + _FD_RESERVE > soft:
        logger.warning(
            "the open-file limit (%d) leaves room for fewer connections than "
            "--max-connections (%d); accepting beyond it fails with EMFILE",
            soft,
            max_connections,
        )
