"""What a client sees when an engine's ``generate`` raises, as Dynamo maps it."""

from __future__ import annotations

import asyncio

from penstock.errors import (
    ClientClosedRequest,
    EngineError,
    GatewayTimeoutError,
    InvalidRequestError,
    OverloadedError,
    PenstockError,
    ServiceUnavailableError,
)

_CLIENT_ERRORS = ("InvalidArgument",)
_TIMEOUTS = ("ConnectionTimeout",)
_UNAVAILABLE = ("EngineShutdown", "CannotConnect", "Disconnected", "WorkerUnavailable")
_OVERLOADED = ("RouterQueueLimitExceeded",)
_CANCELLED = ("Cancelled",)


def _dynamo_kind(exc: BaseException) -> str | None:
    """The ``dynamo.llm.exceptions`` class ``exc`` is (matched by module and name, so the
    gateway needs no Dynamo import), or None."""
    for base in type(exc).__mro__:
        if base.__module__.startswith("dynamo.") and base.__name__ != "DynamoException":
            if base.__name__ in (
                *_CLIENT_ERRORS,
                *_TIMEOUTS,
                *_UNAVAILABLE,
                *_OVERLOADED,
                *_CANCELLED,
            ):
                return base.__name__
    return None


def _int_status(exc: BaseException) -> int | None:
    for name in ("status", "code"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def engine_exception_to_error(exc: BaseException, overload_status: int = 529) -> PenstockError:
    """Map an exception raised by ``generate`` to what the client sees.

    As Dynamo maps them: ``InvalidArgument``, ``ValueError`` and ``TypeError`` are the
    client's fault (400, message kept); an object with an int ``status`` (or ``code``, as
    ``dynamo.llm.exceptions.HttpError``) and a str ``message`` keeps a 4xx status and
    message, and a 503 or overload status; ``TimeoutError`` / ``ConnectionTimeout`` are
    504; ``EngineShutdown``, ``CannotConnect``, ``Disconnected``, ``WorkerUnavailable`` and
    connection errors are 503; ``RouterQueueLimitExceeded`` is the overload status;
    ``Cancelled`` is 499. Everything else is a 500 whose details stay in the log.
    """
    if isinstance(exc, PenstockError):
        return exc
    kind = _dynamo_kind(exc)
    status = _int_status(exc)
    message = getattr(exc, "message", None)
    if kind is None and status is not None and isinstance(message, str):
        if 400 <= status < 500:
            error: PenstockError = InvalidRequestError(message)
            error.status_code = status
            return error
        if status == 503:
            return ServiceUnavailableError("Service temporarily unavailable")
        if status in (429, 529, overload_status):
            return _overloaded(overload_status)
        return EngineError("Internal server error")
    if kind in _CLIENT_ERRORS or isinstance(exc, ValueError | TypeError):
        return InvalidRequestError(str(exc) or type(exc).__name__)
    if kind in _TIMEOUTS or isinstance(exc, TimeoutError):
        return GatewayTimeoutError("The engine timed out")
    if kind in _UNAVAILABLE or isinstance(exc, ConnectionError | GeneratorExit):
        return ServiceUnavailableError("Service temporarily unavailable")
    if kind in _OVERLOADED:
        return _overloaded(overload_status)
    if kind in _CANCELLED or isinstance(exc, asyncio.CancelledError):
        return ClientClosedRequest("Request cancelled")
    return EngineError("Internal server error")


def _overloaded(status: int) -> PenstockError:
    error = OverloadedError("Service temporarily overloaded")
    error.status_code = status
    return error
