"""The lean request path of the hot inference routes: chat, completions, SGLang ``/generate``.

FastAPI's request machinery (matching the path against every route, its exit stacks and
exception wrappers, dependency solving, binding the endpoint's arguments) was about half
of the server's CPU for a short request (``bench/README.md``). :class:`HotRoutes`, the
innermost middleware, serves these routes itself when method and path match exactly;
everything else, and every other method or spelling of these paths (405, the trailing
slash redirect), goes on to FastAPI. The routes stay declared on their routers, so the
OpenAPI document lists them with their request models, and each request gets what
FastAPI gave it:

* the inference-key rule of :func:`~penstock.routers.security.require_inference_key`,
  checked before the body is read;
* the body as JSON when its content type is ``application/json`` (or ``+json``), read by
  the parser of :mod:`penstock.routers.json_body`, validated into the endpoint's body model
  with FastAPI's errors (an empty body is a missing field, a malformed one
  ``json_invalid``), so the handlers turn them into the same 400 naming the field;
* the endpoint called with the body and the request, its response sent;
* an error raised before the response begins answered by the app's handlers
  (:func:`~penstock.app.handlers.handle_error`): the same envelopes and statuses.

A whole JSON response leaves in one write, its start held for its body by the
connection's :class:`~penstock.serving.sse.FrameWriter`.
"""

from __future__ import annotations

import json
from typing import Any, get_type_hints

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from penstock.app.handlers import handle_error
from penstock.routers.json_body import parse_json
from penstock.routers.security import check_inference_key
from penstock.serving.sse import FRAME_WRITER_KEY
from penstock.settings import Settings

# The (method, path) of the operations served here; each endpoint is ``(body, request)``.
HOT_OPERATIONS = frozenset(
    {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/generate"),
        ("PUT", "/generate"),
    }
)

_NO_BODY = object()
# Responses that send their whole body right after their start, with nothing between.
_WHOLE_BODY_RESPONSES = (Response, JSONResponse)


def _is_json(content_type: str) -> bool:
    """FastAPI's test: main type ``application``, subtype ``json`` or ``*+json``."""
    media_type = content_type.partition(";")[0].strip().lower()
    main, _, subtype = media_type.partition("/")
    return main == "application" and (subtype == "json" or subtype.endswith("+json"))


class HotRoute:
    """One operation of :data:`HOT_OPERATIONS`, served without FastAPI's machinery."""

    __slots__ = ("adapter", "endpoint", "route", "settings")

    def __init__(self, route: APIRoute, settings: Settings) -> None:
        self.route = route
        self.endpoint = route.endpoint
        self.adapter: TypeAdapter[Any] = TypeAdapter(get_type_hints(route.endpoint)["body"])
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # What FastAPI's routing leaves for the middlewares: the access line's route.
        scope["route"] = self.route
        scope["endpoint"] = self.endpoint
        request = Request(scope, receive, send)
        try:
            check_inference_key(request, scope["path"], self.settings)
            response = await self.endpoint(self._validate(await self._parse(request)), request)
        except Exception as exc:
            response = await handle_error(request, exc)
        # Neither the request nor its body (raw and validated) is needed while the response
        # streams; an open stream keeps only what its response holds.
        del request
        writer = scope.get(FRAME_WRITER_KEY)
        if writer is not None and type(response) in _WHOLE_BODY_RESPONSES:
            writer.hold_start()
        await response(scope, receive, send)

    async def _parse(self, request: Request) -> Any:
        try:
            raw = await request.body()
            if not raw:
                return _NO_BODY
            content_type = request.headers.get("content-type")
            if content_type and _is_json(content_type):
                return parse_json(raw)
            return raw
        except json.JSONDecodeError as exc:
            error = {
                "type": "json_invalid",
                "loc": ("body", exc.pos),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": exc.msg},
            }
            raise RequestValidationError([error], body=exc.doc) from exc
        except HTTPException:
            raise
        except Exception as exc:
            raise HTTPException(400, "There was an error parsing the body") from exc

    def _validate(self, value: Any) -> Any:
        if value is _NO_BODY:
            missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
            raise RequestValidationError([missing])
        try:
            return self.adapter.validate_python(value, from_attributes=True)
        except ValidationError as exc:
            errors = [
                {**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)
            ]
            raise RequestValidationError(errors, body=value) from None


class HotRoutes:
    """Innermost middleware: :data:`HOT_OPERATIONS` served by :class:`HotRoute`, the rest
    passed on to FastAPI."""

    def __init__(self, app: ASGIApp, *, routes: dict[tuple[str, str], HotRoute]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = self.routes.get((scope["method"], scope["path"]))
            if route is not None:
                await route(scope, receive, send)
                return
        await self.app(scope, receive, send)


def hot_routes(routes: list[Any], settings: Settings) -> dict[tuple[str, str], HotRoute]:
    """The :class:`HotRoute` of each operation of :data:`HOT_OPERATIONS` among ``routes``."""
    found: dict[tuple[str, str], HotRoute] = {}
    for route in routes:
        if not isinstance(route, APIRoute):
            continue
        for method in route.methods:
            if (method, route.path) in HOT_OPERATIONS:
                found[(method, route.path)] = HotRoute(route, settings)
    missing = HOT_OPERATIONS - found.keys()
    if missing:
        raise RuntimeError(f"hot operations without a route: {sorted(missing)}")
    return found
