"""Fields a request sent that its model does not declare, at every depth, and the one
error that names them.

Request models keep undeclared fields (``extra="allow"``) instead of failing validation
on them, so the operator's ``--allow-unknown-fields`` can decide, and so the 400 names
every unknown field by its full path (``sampling_params.foo``, ``messages[0].bar``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from penstock.errors import InvalidRequestError, clip


def unknown_field_error(paths: list[str]) -> InvalidRequestError:
    """400 ``unknown_field`` naming ``paths`` (sorted; the first is the ``param``)."""
    names = sorted(paths)
    return InvalidRequestError(
        f"Unknown field(s): {', '.join(clip(name) for name in names)}",
        param=names[0],
        code="unknown_field",
    )


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The path of every undeclared field in ``model`` and the models nested in it."""
    return list(_walk(model, prefix))


def _walk(value: Any, path: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        extra = value.__pydantic_extra__
        if extra:
            for name in extra:
                yield f"{path}.{name}" if path else name
        # Only what the client sent can hold what it sent: defaults have no extras.
        for name in value.__pydantic_fields_set__:
            child = value.__dict__.get(name)
            if child is not None and not isinstance(child, str | int | float | bool):
                yield from _walk(child, f"{path}.{name}" if path else name)
    elif isinstance(value, list) and value and isinstance(value[0], BaseModel | list):
        # A list holds one kind of item: a list of token ids is not walked id by id.
        for index, item in enumerate(value):
            yield from _walk(item, f"{path}[{index}]")


def refuse_unknown(model: BaseModel, allowed: bool, prefix: str = "") -> None:
    """400 for undeclared fields anywhere in ``model``, unless the operator allows them."""
    if allowed:
        return
    paths = unknown_fields(model, prefix)
    if paths:
        raise unknown_field_error(paths)


def refuse_unsupported(model: BaseModel, defaults: Mapping[str, Any], prefix: str = "") -> None:
    """400 ``unsupported_parameter`` for a field of the upstream request model this server
    cannot honour, unless it holds the value that asks for nothing (``defaults[name]``,
    or None); such a field is accepted and leaves the unknown-field check."""
    extra = model.__pydantic_extra__
    if not extra:
        return
    for name, default in defaults.items():
        if name not in extra:
            continue
        value = extra[name]
        if value is not None and value != default:
            path = f"{prefix}.{name}" if prefix else name
            raise InvalidRequestError(
                f"{path} is not supported by this server; got {clip(repr(value))}",
                param=path,
                code="unsupported_parameter",
            )
        del extra[name]
