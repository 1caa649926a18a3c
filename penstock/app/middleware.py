"""Pure ASGI middleware: request id, body limit, drain gate and in-flight accounting."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import orjson
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from penstock.errors import PayloadTooLargeError, PenstockError, ServiceUnavailableError

if TYPE_CHECKING:
    from penstock.gateway import Gateway

REQUEST_ID_HEADER = b"x-request-id"
_MAX_REQUEST_ID_LEN = 256


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` so frameworks that wrap body errors still answer 413."""

    def __init__(self) -> None:
        super().__init__(status_code=413)


class GatewayMiddleware:
    """Cross-cutting rules every HTTP request goes through.

    * ``X-Request-Id`` is taken from the request (or generated), stored in
      ``scope["state"]["request_id"]`` and echoed on every response;
    * bodies over ``max_body_bytes`` get 413, whether or not a Content-Length was sent;
    * while draining, new requests get 503 except the always-open paths;
    * ``gateway.http_inflight`` counts requests whose response has not finished, for
      graceful drain.
    """

    def __init__(
        self, app: ASGIApp, *, gateway: Gateway, always_open_paths: frozenset[str]
    ) -> None:
        self.app = app
        self.gateway = gateway
        self.max_body_bytes = gateway.settings.max_body_bytes
        self.always_open_paths = always_open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        echoed = request_id.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER
                ]
                headers.append((REQUEST_ID_HEADER, echoed))
                message = {**message, "headers": headers}
            await send(message)

        if self.gateway.draining and scope["path"] not in self.always_open_paths:
            await _send_error(send_with_id, ServiceUnavailableError("The server is shutting down"))
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _send_error(send_with_id, self._too_large())
            return

        received = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send_with_id(message)

        self.gateway.http_inflight += 1
        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await _send_error(send_with_id, self._too_large())
        finally:
            self.gateway.http_inflight -= 1

    def _too_large(self) -> PayloadTooLargeError:
        limit_mb = self.max_body_bytes / (1024 * 1024)
        return PayloadTooLargeError(f"Request body exceeds the {limit_mb:g} MB limit")


def _request_id(scope: Scope) -> str:
    for key, value in scope.get("headers", []):
        if key == REQUEST_ID_HEADER:
            text = value.decode("latin-1").strip()
            if text and len(text) <= _MAX_REQUEST_ID_LEN and text.isprintable():
                return text
            break
    return str(uuid.uuid4())


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_error(send: Send, error: PenstockError) -> None:
    body = orjson.dumps(error.envelope())
    await send(
        {
            "type": "http.response.start",
            "status": error.status_code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
