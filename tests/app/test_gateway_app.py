"""``GatewayApp`` enters its middleware stack itself for HTTP requests, skipping FastAPI's
and Starlette's ``__call__``: a request must still see what those would have set."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.types import Receive, Scope, Send

from penstock.app.factory import create_app
from tests.support.inprocess import start_gateway


async def _scope_seen(asgi: Any, path: str) -> dict[str, Any]:
    transport = httpx.ASGITransport(app=asgi, client=("127.0.0.1", 40001))
    async with httpx.AsyncClient(transport=transport, base_url="http://penstock") as http:
        response = await http.get(path, headers={"x-request-id": "probe"})
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_request_sees_the_scope_fastapi_would_have_given_it() -> None:
    gateway = await start_gateway()
    try:
        app = create_app(gateway)
        app.root_path = "/gateway"

        @app.get("/scope-probe")
        async def probe(request: Request) -> dict[str, Any]:
            scope = request.scope
            return {
                "keys": sorted(key for key in scope if isinstance(key, str)),
                "app_is_gateway": scope["app"] is app,
                "root_path": scope["root_path"],
                "state": sorted(scope.get("state", {})),
            }

        async def through_fastapi(scope: Scope, receive: Receive, send: Send) -> None:
            await FastAPI.__call__(app, scope, receive, send)

        async with app.router.lifespan_context(app):
            # The first request builds the middleware stack (through FastAPI's own path);
            # the shortcut is taken from then on.
            full = await _scope_seen(through_fastapi, "/scope-probe")
            assert app.middleware_stack is not None
            shortcut = await _scope_seen(app, "/scope-probe")
    finally:
        await gateway.host.cleanup()
    assert shortcut == full
    assert shortcut["app_is_gateway"] is True
    assert shortcut["root_path"] == "/gateway"
