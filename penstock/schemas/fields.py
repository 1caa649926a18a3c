"""Fields a request sent that its model does not declare, at every depth, and the one
error that names them.

Request models keep undeclared fields (``extra="allow"``) instead of failing validation
on them. By default they are ignored, as vLLM ignores them: each field's first sighting is
logged, and the response names them in :data:`IGNORED_FIELDS_HEADER`, so a client can see
what had no effect. ``--no-allow-unknown-fields`` refuses them instead, the 400 naming
every one by its full path (``sampling_params.foo``, ``messages[0].bar``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel

from penstock.errors import InvalidRequestError, clip

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-penstock-ignored-fields"
"""The response header naming the request's fields that were ignored, comma-separated."""

# A request runs in one task, its response built in that task: the fields its checks
# ignored reach the response without passing through every layer between.
_ignored_fields: ContextVar[tuple[str, ...]] = ContextVar("ignored_fields", default=())
# Names already logged as a warning: a client sending one on every request logs it once.
_warned: set[str] = set()
_MAX_WARNED = 1024
_MAX_HEADER_CHARS = 1024


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
    paths: list[str] = []
    _collect(model, prefix, paths)
    return paths


# What a list is walked for when its first item is one: a list holds one kind of item, so
# a list of token ids is not walked id by id.
_WALKED_ITEMS = (BaseModel, list)


def _collect(model: BaseModel, path: str, paths: list[str]) -> None:
    # A list of appends, not a generator, and only models and lists of them are called on:
    # it runs for every request's model and its parts.
    extra = model.__pydantic_extra__
    if extra:
        paths.extend(f"{path}.{name}" if path else name for name in extra)
    sent = model.__pydantic_fields_set__
    values = model.__dict__
    # Only what the client sent can hold what it sent (defaults have no extras), and only
    # a field whose type can hold a model.
    for name in _nested_fields(type(model)):
        if name in sent:
            child = values.get(name)
            if isinstance(child, BaseModel):
                _collect(child, f"{path}.{name}" if path else name, paths)
            elif isinstance(child, list) and child and isinstance(child[0], _WALKED_ITEMS):
                _collect_items(child, f"{path}.{name}" if path else name, paths)


def _collect_items(items: list[Any], path: str, paths: list[str]) -> None:
    for index, item in enumerate(items):
        if isinstance(item, BaseModel):
            _collect(item, f"{path}[{index}]", paths)
        elif isinstance(item, list) and item and isinstance(item[0], _WALKED_ITEMS):
            _collect_items(item, f"{path}[{index}]", paths)


@functools.cache
def _nested_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``model`` whose values can be or hold a model, found once a class."""
    return tuple(
        name for name, field in model.model_fields.items() if _may_hold_model(field.annotation)
    )


def _may_hold_model(annotation: Any) -> bool:
    """Whether a value of ``annotation`` can be or hold a model; True when unsure."""
    origin = get_origin(annotation)
    if origin is Literal:
        return False
    if origin is Annotated:
        return _may_hold_model(get_args(annotation)[0])
    if origin is not None:
        return any(_may_hold_model(arg) for arg in get_args(annotation))
    if annotation is Any:
        # JSON as it was sent: validation builds no model in it.
        return False
    if isinstance(annotation, type):
        return issubclass(annotation, BaseModel) or annotation is object
    # A forward reference, a type variable: it may.
    return annotation is not None


def refuse_unknown(model: BaseModel, allowed: bool, prefix: str = "") -> None:
    """400 for undeclared fields anywhere in ``model``; ignored and noted for the response
    instead when the operator allows them."""
    refuse_or_ignore(unknown_fields(model, prefix), allowed)


def refuse_or_ignore(paths: list[str], allowed: bool) -> None:
    """400 naming ``paths``, the request's unknown fields; or, when the operator allows
    them, each logged once and all named in the response's header."""
    if not paths:
        return
    if not allowed:
        raise unknown_field_error(paths)
    _ignored_fields.set(_ignored_fields.get() + tuple(paths))
    new = [path for path in paths if path not in _warned]
    if new:
        if len(_warned) < _MAX_WARNED:
            _warned.update(new)
        logger.warning(
            "The following fields were present in the request but ignored: %s",
            ", ".join(clip(path) for path in new),
        )


def ignored_fields_header() -> tuple[bytes, bytes] | None:
    """The :data:`IGNORED_FIELDS_HEADER` of this request's response, taken (a server that
    runs requests one after another in one context starts the next with none); None when
    nothing was ignored. Names are ASCII-escaped and the value bounded, as a header must be."""
    ignored = _ignored_fields.get()
    if not ignored:
        return None
    _ignored_fields.set(())
    value = ", ".join(dict.fromkeys(ignored))
    value = value.encode("ascii", "backslashreplace").decode("ascii")
    printable = "".join(c if " " <= c <= "~" else "?" for c in value)
    return IGNORED_FIELDS_HEADER.encode(), printable[:_MAX_HEADER_CHARS].encode()


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
