"""Exception handlers: every error leaves as the OpenAI envelope with the right status."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from penstock.errors import (
    HttpConnectionError,
    HttpStatusError,
    HttpTimeoutError,
    InternalServerError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    PenstockError,
    ServiceUnavailableError,
    clip,
)
from penstock.schemas.fields import unknown_field_error

_EXPECTED_OUTAGES = (
    HttpStatusError,
    HttpTimeoutError,
    HttpConnectionError,
    ServiceUnavailableError,
)

logger = logging.getLogger(__name__)


def error_response(error: PenstockError) -> Response:
    return Response(
        orjson.dumps(error.envelope()),
        status_code=error.status_code,
        media_type="application/json",
        headers=error.headers or None,
    )


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_type_tag(part: str) -> bool:
    """Pydantic adds union-member tags to error locations; they aren't field names."""
    return "[" in part or part in _TYPE_TAGS or part[:1].isupper()


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [
        str(p)
        for p in loc
        if p not in ("body", "query", "path") and not (isinstance(p, str) and _is_type_tag(p))
    ]
    parts = [p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1]]
    path = ""
    for part in parts:
        if part.isdigit():
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path


def validation_error_from(exc: RequestValidationError) -> InvalidRequestError:
    """Turn FastAPI's 422 into a 400 naming the first offending field and the reason."""
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("Invalid request body")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    field = _field_path(loc)
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return unknown_field_error(
            [_field_path(tuple(e.get("loc", ()))) for e in errors if e.get("type") == kind]
        )
    message = first.get("msg", "invalid value")
    if kind == "missing":
        message = "Field required"
    elif isinstance(first.get("input"), str | int | float | bool) and kind != "value_error":
        message += f"; got {clip(repr(first['input']))}"
    return InvalidRequestError(
        f"{clip(field)}: {message}" if field else message,
        param=field or _unlocated_param(first, loc),
        code="invalid_value",
    )


def _unlocated_param(error: Any, loc: tuple[Any, ...]) -> str | None:
    """The param of an error about the whole body: the field a validator named, else the
    body itself."""
    raised = (error.get("ctx") or {}).get("error")
    if isinstance(raised, InvalidRequestError) and raised.param:
        return raised.param
    return "body" if loc[:1] == ("body",) else None


async def _penstock_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, PenstockError)
    # Shed requests are summed up by the admission gate, not logged one by one. An
    # unreachable or failing upstream, or a service that says it is unavailable, is the
    # operator's warning, not the server's own error.
    if exc.status_code >= 500 and not isinstance(exc, OverloadedError):
        level = logging.WARNING if isinstance(exc, _EXPECTED_OUTAGES) else logging.ERROR
        logger.log(level, "request failed: %s", exc.message)
    return error_response(exc)


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error_from(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        error: PenstockError = NotFoundError(str(exc.detail) or "Not found")
    elif exc.status_code == 413:
        limit_mb = request.app.state.gateway.settings.max_body_mb
        error = PayloadTooLargeError(f"Request body exceeds the {limit_mb:g} MB limit")
    elif exc.status_code == 405:
        error = InvalidRequestError(str(exc.detail), code="method_not_allowed")
        error.status_code = 405
    elif exc.status_code < 500:
        error = InvalidRequestError(str(exc.detail))
        error.status_code = exc.status_code
    else:
        error = InternalServerError()
    return error_response(error)


async def _unhandled(_: Request, exc: Exception) -> Response:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(InternalServerError())


async def handle_error(request: Request, exc: Exception) -> Response:
    """What the installed handlers answer ``exc`` with, for the routes served outside
    FastAPI's exception middleware (:mod:`penstock.app.hot`)."""
    if isinstance(exc, PenstockError):
        return await _penstock_error(request, exc)
    if isinstance(exc, RequestValidationError):
        return await _validation_error(request, exc)
    if isinstance(exc, StarletteHTTPException):
        return await _http_error(request, exc)
    return await _unhandled(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(PenstockError, _penstock_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
