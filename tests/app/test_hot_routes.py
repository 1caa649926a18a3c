"""The hot inference routes, served outside FastAPI's router, answer as FastAPI did."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from penstock.app.factory import create_app
from penstock.serving.sse import DISCONNECT_KEY, FRAME_WRITER_KEY, DisconnectSignal
from tests.support.inprocess import LOOPBACK_CLIENT as LOOPBACK
from tests.support.inprocess import asgi_client, start_gateway

MODEL = "sample-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    gateway = await start_gateway(api_keys=["k"])
    try:
        async for http in asgi_client(gateway):
            yield http
    finally:
        await gateway.host.cleanup()


KEY = {"Authorization": "Bearer k"}


async def test_the_key_is_checked_before_the_body_is_read(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", content=b"{not json")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("content", "headers", "message"),
    [
        (b"", {"content-type": "application/json"}, "Field required"),
        (b"{not json", {"content-type": "application/json"}, "Invalid JSON body"),
        (b'{"model": "m"}', {"content-type": "text/plain"}, "Content-Type 'text/plain'"),
        (b'{"a": "\xc3\x28"}', {"content-type": "application/json"}, "error parsing the body"),
    ],
    ids=["empty", "malformed", "not-json-type", "not-utf8"],
)
async def test_bodies_that_are_no_request_get_400(
    client: httpx.AsyncClient, content: bytes, headers: dict[str, str], message: str
) -> None:
    response = await client.post("/v1/completions", content=content, headers={**KEY, **headers})
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


async def test_a_field_error_names_the_field(client: httpx.AsyncClient) -> None:
    response = await client.post("/generate", json={"input_ids": [1], "stream": 3}, headers=KEY)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream"


async def test_every_operation_answers_and_other_methods_reach_fastapi(
    client: httpx.AsyncClient,
) -> None:
    chat = await client.post("/v1/chat/completions", json=CHAT, headers=KEY)
    assert chat.status_code == 200
    assert chat.json()["object"] == "chat.completion"
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert (await client.post("/v1/completions", json=completion, headers=KEY)).status_code == 200
    for method in ("POST", "PUT"):
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        generated = await client.request(method, "/generate", json=body, headers=KEY)
        assert generated.status_code == 200
        assert len(generated.json()["output_ids"]) == 2
    wrong_method = await client.get("/v1/chat/completions", headers=KEY)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"


class RecordingWriter:
    """A connection's frame writer that takes every frame and records what it is asked."""

    def __init__(self, events: list[object]) -> None:
        self.events = events

    def hold_start(self) -> None:
        self.events.append("hold start")

    def write(self, frame: bytes) -> bool:
        self.events.append(frame)
        return True


async def answer(app: Any, body: dict[str, Any]) -> list[object]:
    """What the app asks of the connection for one request: a held start, the ASGI
    messages it sends (by type) and the frames it writes."""
    events: list[object] = []
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer k")],
        "client": LOOPBACK,
        "server": LOOPBACK,
        "state": {},
        FRAME_WRITER_KEY: RecordingWriter(events),
        DISCONNECT_KEY: DisconnectSignal(),
    }
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        events.append(message["type"])

    await app(scope, receive, send)
    return events


async def test_a_response_start_is_held_for_the_bytes_that_follow_it() -> None:
    """A whole response (an answer or an error) and a stream's opening frame (its role
    chunk and first token) leave the connection with the start, in one write."""
    gateway = await start_gateway(api_keys=["k"])
    app = create_app(gateway)
    try:
        async with app.router.lifespan_context(app):
            whole = await answer(app, CHAT)
            refused = await answer(app, {**CHAT, "max_tokens": -1})
            stream = await answer(app, {**CHAT, "stream": True})
    finally:
        await gateway.host.cleanup()
    body = ["hold start", "http.response.start", "http.response.body"]
    assert whole == body
    assert refused == body
    assert stream[:2] == ["hold start", "http.response.start"]
    opening = stream[2]
    assert isinstance(opening, bytes)
    assert b'"role":"assistant"' in opening
    assert opening.count(b"data: ") == 2
    assert stream[-1] == "http.response.body"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"content-type": "application/json; charset=utf-8"},
        {"content-type": "application/vnd.x+json"},
    ],
    ids=["no-type", "charset", "plus-json"],
)
async def test_a_json_body_is_read_without_a_type_or_with_any_json_type(
    client: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hello"}).encode()
    for path in ("/v1/completions", "/tokenize"):
        response = await client.post(path, content=body, headers={**KEY, **headers})
        assert response.status_code == 200, (path, response.text)


async def test_every_json_route_refuses_a_body_of_another_type_alike(
    client: httpx.AsyncClient,
) -> None:
    """The typed routes, the admin routes and the media routes read JSON by one rule."""
    for path in ("/v1/chat/completions", "/tokenize", "/engine/flush_cache", "/v1/videos"):
        response = await client.post(
            path,
            content=b"{}",
            headers={**KEY, "content-type": "application/x-www-form-urlencoded"},
        )
        assert response.status_code == 400, path
        error = response.json()["error"]
        assert error["code"] == "invalid_body", path
        assert "Content-Type 'application/x-www-form-urlencoded'" in error["message"], path
