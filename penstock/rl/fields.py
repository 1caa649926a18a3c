"""Admin request bodies: read a JSON object and check field types, naming the field.

Pause modes and sleep tags are checked by the engines' own parsers
(:mod:`penstock.engines.controls`), so the admin plane refuses what an engine would.

:func:`tensor_update_body`: an ``update_weights_from_tensor`` body as the engine gets it. A
pickled entry on a server without ``--trust-weight-payloads`` is a 400 naming the flag
before the engine sees it; the trust the engine is told is the operator's, never the
client's.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fastapi import Request

from penstock.engines.controls import ControlRejected, parse_mode, parse_tags
from penstock.engines.weights.sync import TRUST_FLAG, is_pickled
from penstock.errors import InvalidRequestError, RLAdminValidationError
from penstock.schemas.json_body import NO_BODY, read_json_body

TRUST_KEY = "trust_weight_payloads"

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


def version_number(body: dict[str, Any], field: str) -> int:
    """A required weight version number (a non-negative integer, or one in digits)."""
    value = body.get(field)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(field, "must be a non-negative integer")
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


def from_rejection(error: ControlRejected, field: str) -> InvalidRequestError:
    return InvalidRequestError(str(error), param=error.field or field, code="invalid_value")


def mode_field(body: dict[str, Any], field: str, default: str) -> str:
    try:
        return parse_mode(body.get(field), field, default)
    except ControlRejected as exc:
        raise from_rejection(exc, field) from exc


def tags_field(body: dict[str, Any], field: str = "tags") -> list[str] | None:
    try:
        tags = parse_tags(body.get(field), field)
    except ControlRejected as exc:
        raise from_rejection(exc, field) from exc
    return None if tags is None else list(body[field])


def tensor_update_body(body: dict[str, Any], *, trusted: bool) -> dict[str, Any]:
    payloads = body.get("serialized_named_tensors")
    if payloads is None and "named_tensors" in body:
        # The sample engine's JSON form: plain numbers, nothing to unpickle.
        return {k: v for k, v in body.items() if k != TRUST_KEY}
    if not isinstance(payloads, list) or not payloads:
        raise InvalidRequestError(
            "'serialized_named_tensors' must be a non-empty list of base64 strings",
            param="serialized_named_tensors",
            code="invalid_value",
        )
    for entry in payloads:
        if not isinstance(entry, str):
            raise InvalidRequestError(
                "'serialized_named_tensors' must hold base64 strings",
                param="serialized_named_tensors",
                code="invalid_value",
            )
        try:
            head = base64.b64decode(entry[:8], validate=True)
        except (binascii.Error, ValueError):
            head = b""
        if is_pickled(head) and not trusted:
            raise InvalidRequestError(
                "'serialized_named_tensors' holds a pickled payload, and unpickling runs code "
                "the sender chose: send base64 safetensors bytes, or start the server with "
                f"{TRUST_FLAG} if this trainer is trusted",
                param="serialized_named_tensors",
                code="untrusted_payload",
            )
    return {**{k: v for k, v in body.items() if k != TRUST_KEY}, TRUST_KEY: trusted}
