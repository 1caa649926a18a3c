"""Pure ASGI middleware: request id, body limit, drain gate, in-flight accounting, access log."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import orjson
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from penstock.app.logs import access_logger, log_access
from penstock.errors import (
    PayloadTooLargeError,
    PenstockError,
    ServerShutdownError,
    ServiceUnavailableError,
)
from penstock.serving.framing import error_frame
from penstock.serving.sse import DONE_FRAME, WIRE_SEND_KEY

if TYPE_CHECKING:
    from penstock.gateway import Gateway

REQUEST_ID_HEADER = b"x-request-id"
# Set in ``scope["state"]`` by the HTTP protocol when it answered the client itself (a
# stalled body's 408): the access line shows that status, not what the app then sent.
ANSWERED_STATUS_KEY = "answered_status"
_MAX_REQUEST_ID_LEN = 256


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` so frameworks that wrap body errors still answer 413."""

    def __init__(self) -> None:
        super().__init__(status_code=413)


class OpenRequests:
    """The tasks of the HTTP requests whose response has not ended, so that a shutdown
    whose grace period ran out can end them (:meth:`cut`) with a proper last message."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.cutting = False
        self.streams_cut = 0
        self.requests_cut = 0

    def cut(self) -> list[asyncio.Task[Any]]:
        """Cancel every open request; each ends as :class:`GatewayMiddleware` says. Returns
        the tasks, to wait for."""
        self.cutting = True
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        return tasks


class GatewayMiddleware:
    """Cross-cutting rules every HTTP request goes through.

    * ``X-Request-Id`` is taken from the request (or generated), stored in
      ``scope["state"]["request_id"]`` and echoed on every response;
    * bodies over ``max_body_bytes`` get 413, whether or not a Content-Length was sent;
    * while draining, new requests get 503 except the always-open paths;
    * ``gateway.http_inflight`` counts requests whose response has not finished, for
      graceful drain, and ``open_requests`` holds their tasks;
    * a request cut by ``open_requests.cut()`` (the grace period is over) ends with a 503
      ``server_shutdown`` envelope if its response had not begun; an event stream ends
      with a ``server_shutdown`` error frame and ``data: [DONE]`` after its last whole
      frame; any other begun response is left for uvicorn to close;
    * once the response has ended (the last frame of a stream included), one access line
      is logged unless ``settings.access_log`` is off. Its token counts come from
      ``scope["state"]["usage"]``: a callable the serving layer leaves there, returning
      the response's OpenAI ``usage``; it is called once, so streams pay nothing per chunk.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        gateway: Gateway,
        always_open_paths: frozenset[str],
        open_requests: OpenRequests | None = None,
    ) -> None:
        self.app = app
        self.gateway = gateway
        self.open_requests = open_requests or OpenRequests()
        self.max_body_bytes = gateway.settings.max_body_bytes
        self.always_open_paths = always_open_paths
        self.access_log = gateway.settings.access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        exchange = _Exchange(send, receive, request_id.encode("latin-1"), self.max_body_bytes)
        started = time.perf_counter()
        # One coroutine for the whole request (no inner one for the guarded part): an open
        # stream keeps every frame of its middlewares for as long as it is open.
        try:
            if self.gateway.draining and scope["path"] not in self.always_open_paths:
                await _send_error(
                    exchange.send, ServiceUnavailableError("The server is shutting down")
                )
                return
            declared = _content_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                await _send_error(exchange.send, self._too_large())
                return
            task = asyncio.current_task()
            assert task is not None
            self.gateway.http_inflight += 1
            self.open_requests.tasks.add(task)
            try:
                await self.app(scope, exchange.receive, exchange.send)
            except BodyTooLarge:
                if not exchange.response_started:
                    await _send_error(exchange.send, self._too_large())
            except asyncio.CancelledError:
                if not self.open_requests.cutting:
                    raise
                task.uncancel()
                await self._end_cut(exchange)
            finally:
                self.open_requests.tasks.discard(task)
                self.gateway.http_inflight -= 1
        finally:
            if self.access_log and access_logger.isEnabledFor(logging.INFO):
                usage = state.get("usage")
                log_access(
                    method=scope["method"],
                    route=_route_template(scope),
                    status=state.get(ANSWERED_STATUS_KEY, exchange.status),
                    duration_ms=(time.perf_counter() - started) * 1000,
                    request_id=request_id,
                    usage=usage() if callable(usage) else None,
                )

    async def _end_cut(self, exchange: _Exchange) -> None:
        """The last message of a request the shutdown cut: whole frames were sent before."""
        self.open_requests.requests_cut += 1
        error = ServerShutdownError(
            "The server is shutting down: its grace period ended before this request finished"
        )
        send = exchange.send
        if not exchange.response_started:
            await _send_error(send, error, close=True)
        elif exchange.event_stream:
            self.open_requests.streams_cut += 1
            frame = error_frame(error)
            await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": DONE_FRAME, "more_body": False})

    def _too_large(self) -> PayloadTooLargeError:
        limit_mb = self.max_body_bytes / (1024 * 1024)
        return PayloadTooLargeError(f"Request body exceeds the {limit_mb:g} MB limit")


class _Exchange:
    """One request's passage through :class:`GatewayMiddleware`: the ``send`` and
    ``receive`` the app gets (the request id echoed, the body limit enforced while it is
    read) and what its response began as. One small object rather than a closure with its
    cells each: an open stream holds them for as long as it is open."""

    __slots__ = (
        "echoed",
        "event_stream",
        "max_body_bytes",
        "received",
        "response_started",
        "server_receive",
        "server_send",
        "status",
    )

    def __init__(self, send: Send, receive: Receive, echoed: bytes, max_body_bytes: int) -> None:
        self.server_send = send
        self.server_receive = receive
        self.echoed = echoed
        self.max_body_bytes = max_body_bytes
        self.received = 0
        # What the client sees when the app raises before answering: the server's 500.
        self.status = 500
        self.response_started = False
        self.event_stream = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.response_started = True
            self.event_stream = _is_event_stream(message)
            headers = [
                (k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER
            ]
            headers.append((REQUEST_ID_HEADER, self.echoed))
            message = {**message, "headers": headers}
        await self.server_send(message)

    async def receive(self) -> Message:
        message = await self.server_receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_body_bytes:
                raise BodyTooLarge
        return message


class WireSend:
    """Outermost, around the whole app: leaves the server's ``send`` in the scope, where an
    event stream finds it for its body frames (see :mod:`penstock.serving.sse`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[WIRE_SEND_KEY] = send
        try:
            await self.app(scope, receive, send)
        finally:
            # uvicorn's send is a method of the request's cycle, which holds this scope: a
            # reference cycle that would leave the request's objects (its generation, its
            # text) to the garbage collector's passes. Broken, they are freed at once.
            del scope[WIRE_SEND_KEY]


def _route_template(scope: Scope) -> str:
    """The matched route's path template, so lines group by endpoint; the raw path when
    no route matched (404s, and requests refused before routing)."""
    route = scope.get("route")
    return getattr(route, "path", None) or scope["path"]


def _request_id(scope: Scope) -> str:
    for key, value in scope.get("headers", []):
        if key == REQUEST_ID_HEADER:
            text = value.decode("latin-1").strip()
            if text and len(text) <= _MAX_REQUEST_ID_LEN and text.isprintable():
                return text
            break
    return _new_request_id()


def _new_request_id() -> str:
    """A random (version 4) UUID's text, as ``str(uuid.uuid4())`` writes it, at about a
    third of its cost: one for every request that brings no id of its own."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40
    raw[8] = raw[8] & 0x3F | 0x80
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _is_event_stream(start: Message) -> bool:
    for key, value in start.get("headers", []):
        if key.lower() == b"content-type":
            return bytes(value).startswith(b"text/event-stream")
    return False


async def _send_error(send: Send, error: PenstockError, *, close: bool = False) -> None:
    body = orjson.dumps(error.envelope())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
