"""The hot inference routes, served outside FastAPI's router, answer as FastAPI did."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

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
        (b'{"model": "m"}', {"content-type": "text/plain"}, "valid dictionary"),
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
