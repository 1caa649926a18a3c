"""JSON request bodies parsed by pydantic-core's parser instead of the ``json`` module.

FastAPI parses a JSON body with ``json.loads`` on the event loop, where nothing else runs
meanwhile: about 20 ms for an 8 MB prompt on a small machine, several times what
pydantic-core's parser takes (``bench/README.md``). That parser is stricter: a lone
surrogate escape or a leading byte-order mark is an error to it, but not to ``json``.
Such bodies are parsed again with ``json.loads``, so every body gets exactly the value,
or the error, it always got. Routes with large bodies use :class:`FastJSONRoute`; the hot routes of
:mod:`penstock.app.hot` call :func:`parse_json`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute


def parse_json(body: bytes) -> Any:
    """``body`` as JSON: what ``json.loads`` makes of it, or its error, by the faster parser."""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        return json.loads(body)


class FastJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class FastJSONRoute(APIRoute):
    """A route whose JSON body is read by :class:`FastJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_fast_json(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return with_fast_json
