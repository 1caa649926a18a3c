"""Fetching media over HTTP, safe against server-side request forgery (``dynamo.common.http``).

:class:`HttpClient` has two backends, :class:`HttpxClient` (the default; httpx is a core
dependency) and :class:`AiohttpClient` (``penstock[aiohttp]``). Both raise only the
unified exceptions (``HttpError`` and its subclasses, ``UrlValidationError``, all in
:mod:`penstock.errors`). :mod:`penstock.http.urls` holds the URL policy; :mod:`.base`
explains how a fetch stays on the addresses that were checked.

The process-wide client (``get_default_client``, ``fetch_bytes``, ``close_http_client``)
is built from the ``PENSTOCK_*`` settings (and the seed's ``DYN_*`` variables where those
are unset, :mod:`.env`) on first use; closing it makes the next use read them again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict, Unpack

from penstock.errors import (
    HttpConfigurationError,
    HttpConnectionError,
    HttpError,
    HttpStatusError,
    HttpTimeoutError,
    UrlValidationError,
)
from penstock.http import env
from penstock.http.base import HttpClient, HttpConfigBase
from penstock.http.urls import (
    UrlValidationPolicy,
    describe_media_source,
    is_blocked_ip,
    validate_local_path,
    validate_media_url,
    validate_url,
)

if TYPE_CHECKING:
    from penstock.http.aiohttp_client import AiohttpClient
    from penstock.http.httpx_client import HttpxClient
    from penstock.settings import Settings

__all__ = [
    "AiohttpClient",
    "FetchOptions",
    "HttpClient",
    "HttpConfigBase",
    "HttpConfigurationError",
    "HttpConnectionError",
    "HttpError",
    "HttpStatusError",
    "HttpTimeoutError",
    "HttpxClient",
    "UrlValidationError",
    "UrlValidationPolicy",
    "close_http_client",
    "create_http_client",
    "describe_media_source",
    "fetch_bytes",
    "get_default_client",
    "is_blocked_ip",
    "validate_local_path",
    "validate_media_url",
    "validate_url",
]

_default: HttpClient | None = None


def __getattr__(name: str) -> object:
    # The backends import their HTTP library; only the one in use should be loaded.
    if name == "HttpxClient":
        from penstock.http.httpx_client import HttpxClient

        return HttpxClient
    if name == "AiohttpClient":
        from penstock.http.aiohttp_client import AiohttpClient

        return AiohttpClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_http_client(settings: Settings) -> HttpClient:
    """The client ``--http-backend`` names, configured by the ``--http-*`` settings."""
    config = HttpConfigBase.from_settings(settings)
    if env.http_backend(settings) == "aiohttp":
        from penstock.http.aiohttp_client import AiohttpClient

        return AiohttpClient(config)
    from penstock.http.httpx_client import HttpxClient

    return HttpxClient(config)


def get_default_client() -> HttpClient:
    global _default
    if _default is None:
        from penstock.settings import Settings

        _default = create_http_client(Settings())
    return _default


class FetchOptions(TypedDict, total=False):
    """The keyword options of :meth:`HttpClient.fetch_bytes`."""

    policy: UrlValidationPolicy | None
    max_bytes: int | None
    read_timeout: float | None


async def fetch_bytes(
    url: str,
    timeout: float,  # noqa: ASYNC109 (the seed signature)
    **options: Unpack[FetchOptions],
) -> bytes:
    """:meth:`HttpClient.fetch_bytes` on the process-wide client."""
    return await get_default_client().fetch_bytes(url, timeout, **options)


async def close_http_client() -> None:
    """Close the process-wide client; idempotent."""
    global _default
    client, _default = _default, None
    if client is not None:
        await client.close()
