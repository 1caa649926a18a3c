"""Admin request bodies: read a JSON object and check field types, naming the field."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from penstock.errors import InvalidRequestError, RLAdminValidationError
from penstock.rl.state import PAUSE_MODES, SLEEP_TAGS
from penstock.schemas.json_body import NO_BODY, read_json_body

_MISSING = object()


async def json_object_body(request: Request) -> dict[str, Any]:
    """The body as a dict: empty means ``{}``; a body that is not JSON
    (:func:`~penstock.schemas.json_body.read_json_body`) or not an object is a 400."""
    body = await read_json_body(request)
    return {} if body is NO_BODY else require_object(body)


def require_object(body: Any) -> dict[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", code="invalid_body")
    return body


def invalid(field: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{field}' {reason}", param=field, code="invalid_value")


def from_validation(error: RLAdminValidationError, field: str) -> InvalidRequestError:
    return InvalidRequestError(str(error), param=field, code="invalid_value")


def bool_field(body: dict[str, Any], field: str, default: bool) -> bool:
    value = body.get(field, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(field, "must be a boolean")
    return value


def int_field(body: dict[str, Any], field: str, default: int, *, low: int, high: int) -> int:
    value = body.get(field, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(field, "must be an integer")
    if not low <= value <= high:
        raise invalid(field, f"must be between {low} and {high}")
    return value


def str_field(body: dict[str, Any], field: str, *, required: bool = False) -> str | None:
    value = body.get(field, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise invalid(field, "is required")
        return None
    if not isinstance(value, str) or not value:
        raise invalid(field, "must be a non-empty string")
    return value


def required_str(body: dict[str, Any], field: str) -> str:
    value = str_field(body, field, required=True)
    assert value is not None
    return value


def str_list_field(body: dict[str, Any], field: str) -> list[str] | None:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise invalid(field, "must be a list of non-empty strings")
    return value


def mode_field(body: dict[str, Any], field: str, default: str) -> str:
    value = body.get(field, default)
    if value is None:
        return default
    if value not in PAUSE_MODES:
        raise invalid(field, f"must be one of {', '.join(PAUSE_MODES)}; got {value!r}")
    mode: str = value
    return mode


def tags_field(body: dict[str, Any], field: str = "tags") -> list[str] | None:
    tags = str_list_field(body, field)
    if tags is not None:
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise invalid(
                field, f"has unknown tag(s) {', '.join(unknown)}; known: {', '.join(SLEEP_TAGS)}"
            )
    return tags
