"""An in-process gateway on the sample engine, reached over ASGI from a loopback client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from penstock.app.factory import create_app
from penstock.app.server import build_gateway
from penstock.gateway import Gateway
from penstock.settings import Settings

LOOPBACK_CLIENT = ("127.0.0.1", 40001)


async def start_gateway(**settings: object) -> Gateway:
    defaults: dict[str, object] = {"engine": "sample", "engine_args": ["--delay", "0.002"]}
    return await build_gateway(Settings(**{**defaults, **settings}))


async def asgi_client(
    gateway: Gateway, client: tuple[str, int] = LOOPBACK_CLIENT
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(gateway)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://penstock") as http:
            yield http
