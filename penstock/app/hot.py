"""The lean request path of the operations of :data:`penstock.routers.hot.HOT_OPERATIONS`.

FastAPI's request machinery (matching the path against every route, its exit stacks and
exception wrappers, dependency solving, binding the endpoint's arguments) was about half
of the server's CPU for a short request (``bench/README.md``). :class:`HotRoutes`, the
innermost middleware, serves these operations itself when method and path match exactly;
everything else, and every other method or spelling of these paths (405, the trailing
slash redirect), goes on to FastAPI. The routes stay declared on their routers, so the
OpenAPI document lists them with their request models, and each request gets what
FastAPI gave it:

* the inference-key rule of :func:`~penstock.routers.security.require_inference_key`,
  checked before the body is read;
* the body read by :func:`~penstock.schemas.json_body.read_json_body` (its one
  content-type rule; a constraint field too large to be within its limit refused before
  the body is parsed), validated into the endpoint's body model with FastAPI's errors (an
  empty body is a missing field), so the handlers turn them into the same 400 naming the
  field;
* the endpoint called with the body and the request, its response sent (a plain value as
  JSON, as FastAPI sends it);
* an error raised before the response begins answered by the app's handlers
  (:func:`~penstock.app.handlers.handle_error`): the same envelopes and statuses.

A whole JSON response leaves in one write, its start held for its body by the
connection's :class:`~penstock.serving.sse.FrameWriter`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, get_type_hints

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from penstock.app.handlers import handle_error
from penstock.routers.hot import HOT_OPERATIONS
from penstock.routers.security import check_inference_key
from penstock.schemas.json_body import NO_BODY, read_json
from penstock.schemas.unicode import UNICODE_CHECKED
from penstock.serving.guided import refuse_oversized_constraints
from penstock.serving.sse import FRAME_WRITER_KEY
from penstock.settings import Settings

# Responses that send their whole body right after their start, with nothing between.
_WHOLE_BODY_RESPONSES = (Response, JSONResponse)


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
            raw_checked = read_json(request, check_raw=refuse_oversized_constraints)
            body = self._validate(*await raw_checked)
            response = await self.endpoint(body, request)
            if not isinstance(response, Response):
                response = JSONResponse(jsonable_encoder(response))
        except Exception as exc:
            response = await handle_error(request, exc)
        # Neither the request nor its body (raw and validated) is needed while the response
        # streams; an open stream keeps only what its response holds.
        del request
        writer = scope.get(FRAME_WRITER_KEY)
        if writer is not None and type(response) in _WHOLE_BODY_RESPONSES:
            writer.hold_start()
        await response(scope, receive, send)

    def _validate(self, value: Any, unicode_checked: bool) -> Any:
        if value is NO_BODY:
            missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
            raise RequestValidationError([missing])
        try:
            context = UNICODE_CHECKED if unicode_checked else None
            return self.adapter.validate_python(value, from_attributes=True, context=context)
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

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # Not a coroutine function: the caller awaits the chosen app's coroutine itself, so
        # an open stream resumes one coroutine frame fewer on every chunk.
        if scope["type"] == "http":
            route = self.routes.get((scope["method"], scope["path"]))
            if route is not None:
                return route(scope, receive, send)
        return self.app(scope, receive, send)


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
