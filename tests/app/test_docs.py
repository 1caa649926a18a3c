"""The OpenAPI schema and its pages are behind the inference key unless made public."""

from __future__ import annotations

import pytest

from tests.support.inprocess import asgi_client, start_gateway

DOC_PATHS = ["/openapi.json", "/docs", "/redoc"]


async def statuses(headers: dict[str, str] | None = None, **settings: object) -> list[int]:
    gateway = await start_gateway(**settings)
    try:
        async for client in asgi_client(gateway):
            return [(await client.get(path, headers=headers)).status_code for path in DOC_PATHS]
    finally:
        await gateway.host.cleanup()
    raise AssertionError("no client")


@pytest.mark.parametrize(
    ("settings", "headers", "expected"),
    [
        ({"api_keys": ["k"]}, None, 401),
        ({"api_keys": ["k"]}, {"Authorization": "Bearer nope"}, 401),
        ({"api_keys": ["k"]}, {"Authorization": "Bearer k"}, 200),
        ({"api_keys": ["k"], "public_docs": True}, None, 200),
        ({}, None, 200),
    ],
    ids=["keys-no-key", "keys-wrong-key", "keys-key", "public-docs", "no-keys"],
)
async def test_docs_need_the_inference_key_when_keys_are_set(
    settings: dict[str, object], headers: dict[str, str] | None, expected: int
) -> None:
    assert await statuses(headers, **settings) == [expected] * len(DOC_PATHS)


async def test_the_keyed_schema_lists_the_routes() -> None:
    gateway = await start_gateway(api_keys=["k"])
    try:
        async for client in asgi_client(gateway):
            schema = await client.get("/openapi.json", headers={"Authorization": "Bearer k"})
            assert "/v1/chat/completions" in schema.json()["paths"]
            assert "/docs" not in schema.json()["paths"]
            page = await client.get("/docs", headers={"Authorization": "Bearer k"})
            assert "/openapi.json" in page.text
    finally:
        await gateway.host.cleanup()


async def test_every_operation_has_its_own_id() -> None:
    gateway = await start_gateway()
    try:
        async for client in asgi_client(gateway):
            document = (await client.get("/openapi.json")).json()
    finally:
        await gateway.host.cleanup()
    ids = [
        operation["operationId"]
        for operations in document["paths"].values()
        for operation in operations.values()
    ]
    assert ids and len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
