"""The gateway middleware driven as a raw ASGI app: request ids, body limit, drain, in-flight."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from penstock.app.middleware import GatewayMiddleware, OpenRequests
from penstock.gateway import Gateway
from tests.support.inprocess import start_gateway

BODY_LIMIT = 1024
ALWAYS_OPEN = frozenset({"/live"})


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    started = await start_gateway(max_body_mb=BODY_LIMIT / (1024 * 1024))
    yield started
    await started.host.cleanup()


class EchoApp:
    """Reads the whole body and answers its length; remembers what it saw."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.calls = 0
        self.request_id: str | None = None
        self.inflight_seen: int | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        self.request_id = scope["state"]["request_id"]
        self.inflight_seen = self.gateway.http_inflight
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = str(size).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"x-request-id", b"from-the-app")],
            }
        )
        await send({"type": "http.response.body", "body": body})


class Exchange:
    """The response a client got: status, headers, body."""

    def __init__(self, messages: list[Message]) -> None:
        start = messages[0]
        self.status: int = start["status"]
        self.headers: list[tuple[bytes, bytes]] = start["headers"]
        self.body = b"".join(m.get("body", b"") for m in messages[1:])

    def header(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name]

    def json(self) -> Any:
        return orjson.loads(self.body)


async def call(
    middleware: GatewayMiddleware,
    *,
    path: str = "/v1/completions",
    headers: list[tuple[bytes, bytes]] | None = None,
    chunks: list[bytes] | None = None,
) -> Exchange:
    pending: list[Message] = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks or [b""]) - 1}
        for i, chunk in enumerate(chunks or [b""])
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers or []}
    await middleware(scope, receive, send)
    return Exchange(sent)


def wrap(gateway: Gateway) -> tuple[GatewayMiddleware, EchoApp]:
    app = EchoApp(gateway)
    return GatewayMiddleware(app, gateway=gateway, always_open_paths=ALWAYS_OPEN), app


async def test_the_client_request_id_is_used_and_echoed_once(gateway: Gateway) -> None:
    middleware, app = wrap(gateway)
    response = await call(middleware, headers=[(b"x-request-id", b"trace-42")])
    assert app.request_id == "trace-42"
    assert response.header(b"x-request-id") == [b"trace-42"]


@pytest.mark.parametrize("sent", [None, b"", b"bad\x01id", b"x" * 300])
async def test_a_missing_or_unusable_request_id_is_replaced(
    gateway: Gateway, sent: bytes | None
) -> None:
    middleware, app = wrap(gateway)
    headers = [(b"x-request-id", sent)] if sent is not None else []
    response = await call(middleware, headers=headers)
    (echoed,) = response.header(b"x-request-id")
    assert echoed.decode() == app.request_id
    # A random UUID, written as str(uuid.uuid4()) writes one.
    made = uuid.UUID(echoed.decode())
    assert (made.version, made.variant) == (4, uuid.RFC_4122)
    assert str(made) == echoed.decode()


async def test_made_request_ids_differ(gateway: Gateway) -> None:
    middleware, app = wrap(gateway)
    made = set()
    for _ in range(200):
        await call(middleware)
        made.add(app.request_id)
    assert len(made) == 200


async def test_a_declared_body_over_the_limit_is_refused_unread(gateway: Gateway) -> None:
    middleware, app = wrap(gateway)
    too_long = str(BODY_LIMIT + 1).encode()
    response = await call(middleware, headers=[(b"content-length", too_long)])
    assert response.status == 413
    assert response.json()["error"]["code"] == "payload_too_large"
    assert response.header(b"x-request-id")
    assert app.calls == 0


async def test_an_undeclared_body_over_the_limit_is_refused_while_read(
    gateway: Gateway,
) -> None:
    middleware, app = wrap(gateway)
    response = await call(middleware, chunks=[b"x" * 600, b"x" * 600])
    assert response.status == 413
    assert response.json()["error"]["code"] == "payload_too_large"
    assert app.calls == 1
    assert gateway.http_inflight == 0


async def test_a_body_within_the_limit_reaches_the_app(gateway: Gateway) -> None:
    middleware, _ = wrap(gateway)
    response = await call(middleware, chunks=[b"x" * 600, b"x" * 424])
    assert (response.status, response.body) == (200, b"1024")


async def test_while_draining_only_the_always_open_paths_answer(gateway: Gateway) -> None:
    middleware, app = wrap(gateway)
    gateway.draining = True
    refused = await call(middleware)
    assert refused.status == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert app.calls == 0
    assert (await call(middleware, path="/live")).status == 200
    assert app.calls == 1


async def test_a_request_counts_as_in_flight_until_its_response_is_done(
    gateway: Gateway,
) -> None:
    middleware, app = wrap(gateway)
    await call(middleware)
    assert app.inflight_seen == 1
    assert gateway.http_inflight == 0


async def test_an_app_that_fails_is_no_longer_in_flight(gateway: Gateway) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("handler bug")

    middleware = GatewayMiddleware(app, gateway=gateway, always_open_paths=ALWAYS_OPEN)
    with pytest.raises(RuntimeError):
        await call(middleware)
    assert gateway.http_inflight == 0


async def test_lifespan_scopes_pass_through_uncounted(gateway: Gateway) -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    middleware = GatewayMiddleware(app, gateway=gateway, always_open_paths=ALWAYS_OPEN)

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        raise AssertionError(message)

    await middleware({"type": "lifespan"}, receive, send)
    assert seen == ["lifespan"]
    assert gateway.http_inflight == 0


class HangingApp:
    """Sends ``frames`` (after a start with ``content_type``, if any), then waits for ever."""

    def __init__(self, content_type: bytes | None, frames: list[bytes]) -> None:
        self.content_type = content_type
        self.frames = frames
        self.waiting = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.content_type is not None:
            headers = [(b"content-type", self.content_type)]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
        for frame in self.frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        self.waiting.set()
        await asyncio.Event().wait()


async def cut_while_open(gateway: Gateway, app: HangingApp) -> tuple[list[Message], OpenRequests]:
    open_requests = OpenRequests()
    middleware = GatewayMiddleware(
        app, gateway=gateway, always_open_paths=ALWAYS_OPEN, open_requests=open_requests
    )
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    request = asyncio.ensure_future(middleware(scope, receive, send))
    await app.waiting.wait()
    (cut,) = open_requests.cut()
    await request
    assert cut is request and not request.cancelled()
    assert gateway.http_inflight == 0 and not open_requests.tasks
    return sent, open_requests


async def test_a_cut_stream_ends_with_an_error_frame_and_done(gateway: Gateway) -> None:
    app = HangingApp(b"text/event-stream; charset=utf-8", [b'data: {"n":1}\n\n'])
    sent, open_requests = await cut_while_open(gateway, app)
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[0] == b'data: {"n":1}\n\n'
    error = orjson.loads(bodies[1].removeprefix(b"data: "))["error"]
    assert error["code"] == "server_shutdown" and error["type"] == "service_unavailable"
    assert bodies[2:] == [b"data: [DONE]\n\n"]
    assert sent[-1]["more_body"] is False
    assert (open_requests.requests_cut, open_requests.streams_cut) == (1, 1)


async def test_a_cut_request_without_a_response_gets_503(gateway: Gateway) -> None:
    sent, open_requests = await cut_while_open(gateway, HangingApp(None, []))
    response = Exchange(sent)
    assert response.status == 503
    assert response.json()["error"]["code"] == "server_shutdown"
    assert response.header(b"connection") == [b"close"]
    assert (open_requests.requests_cut, open_requests.streams_cut) == (1, 0)


async def test_a_cancel_outside_a_shutdown_still_cancels(gateway: Gateway) -> None:
    app = HangingApp(None, [])
    middleware = GatewayMiddleware(app, gateway=gateway, always_open_paths=ALWAYS_OPEN)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        return None

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    request = asyncio.ensure_future(middleware(scope, receive, send))
    await app.waiting.wait()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert gateway.http_inflight == 0
