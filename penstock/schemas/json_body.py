"""Request bodies as JSON: the one reader of every route that takes a JSON body.

The rule: a body is JSON when its ``Content-Type`` is ``application/json`` or an
``application/*+json`` type (parameters such as ``charset`` aside), or when the request
sends none; an empty body (or only whitespace) is no body, which each route reads its own
way (a missing field, no options). Every other body is a 400 naming the reason: a content
type that is not JSON, text that is not UTF-8, JSON that does not parse.

The typed routes (:mod:`penstock.routers.hot`) read with :func:`read_json_body` through
:class:`~penstock.app.hot.HotRoute`; the admin routes through
:func:`penstock.rl.fields.json_object_body`, the media routes (which also take
``multipart/form-data``) through :func:`penstock.media.requests.read_media_body`.

JSON is parsed by pydantic-core's parser rather than the ``json`` module's: about 20 ms
for an 8 MB prompt on a small machine, on the event loop where nothing else runs
meanwhile, is several times what pydantic-core's parser takes (``bench/README.md``). That
parser is stricter: a lone surrogate escape or a leading byte-order mark is an error to it,
but not to ``json``. Such bodies are parsed again with ``json.loads``, so every body gets
exactly the value, or the error, ``json`` gives it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

import pydantic_core
from starlette.requests import ClientDisconnect, Request

from penstock.errors import InvalidRequestError, clip

NO_BODY: Final = object()
"""What :func:`read_json_body` returns for an empty body."""

JSON_TYPE = "application/json"


def is_json_type(content_type: str | None) -> bool:
    """Whether a body sent with ``content_type`` (None: no header) is read as JSON."""
    if not content_type or content_type == JSON_TYPE:
        # The header nearly every client sends, spelled exactly: no parsing.
        return True
    media_type = content_type.partition(";")[0].strip().lower()
    main, _, subtype = media_type.partition("/")
    return main == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_json(body: bytes) -> tuple[Any, bool]:
    """``body`` as JSON: what ``json.loads`` makes of it, or its error, by the faster parser;
    and whether that parser read it, so that no string in it holds an unpaired surrogate
    (:data:`penstock.schemas.unicode.UNICODE_CHECKED`)."""
    try:
        return pydantic_core.from_json(body), True
    except ValueError:
        return json.loads(body), False


async def read_json_body(
    request: Request,
    *,
    accepted: str = JSON_TYPE,
    check_raw: Callable[[bytes], None] | None = None,
) -> Any:
    """The request's body as JSON, or :data:`NO_BODY`; a 400 for a body that is not JSON
    (``accepted``: what the error tells the client to send instead). ``check_raw`` sees
    the JSON text first, to refuse what would cost too much to parse."""
    body, _ = await read_json(request, accepted=accepted, check_raw=check_raw)
    return body


async def read_json(
    request: Request,
    *,
    accepted: str = JSON_TYPE,
    check_raw: Callable[[bytes], None] | None = None,
) -> tuple[Any, bool]:
    """:func:`read_json_body`, and whether its strings are known to be valid Unicode (see
    :func:`parse_json`)."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise InvalidRequestError("The request body ended early: the client went away") from None
    # ``isspace`` stops at the first other byte, where ``strip`` would copy the body.
    if not raw or raw.isspace():
        return NO_BODY, True
    content_type = request.headers.get("content-type")
    if not is_json_type(content_type):
        raise InvalidRequestError(
            f"The request body is not JSON: Content-Type '{clip(content_type)}'; send {accepted}",
            code="invalid_body",
        )
    if check_raw is not None:
        check_raw(raw)
    try:
        return parse_json(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"Invalid JSON body: {exc.msg} at position {exc.pos}",
            param="body",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise InvalidRequestError(
            "Invalid JSON body: nested too deeply", param="body", code="invalid_json"
        ) from None
    except UnicodeDecodeError:
        raise InvalidRequestError(
            "There was an error parsing the body: it is not UTF-8 text",
            param="body",
            code="invalid_json",
        ) from None
