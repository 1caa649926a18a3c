"""The backend-neutral media fetch: :class:`HttpClient` and what every backend shares.

``fetch_bytes`` with a policy is the SSRF-safe path, the same for every backend:

1. :func:`~penstock.http.urls.check_url` judges the URL and resolves its host once;
2. the checked addresses are *pinned* for the request (:mod:`.pinning`: a context
   variable the backend's connect step reads), so the connection goes to an address that
   was checked, never to a second DNS answer; TLS still verifies the host name's
   certificate;
3. redirects are not followed by the library: each ``Location`` is checked the same way,
   at most ``_MAX_REDIRECTS`` hops;
4. the body is read in chunks and the fetch fails as soon as it passes ``max_bytes``; the
   whole fetch, redirects and body included, runs under one deadline, so a server that
   trickles bytes can't hold it past ``timeout``;
5. the fetch asks for ``identity`` and the libraries decode nothing: a host that sends a
   ``Content-Encoding`` anyway is decoded by :mod:`.decoding` in bounded steps, and
   ``max_bytes`` holds for the decoded bytes.

Without a policy the library follows redirects itself, and the backend's connect step
still checks every address (literal or resolved) against the client's configured policy.
Clients keep one connection pool per kind of network permission (and proxy), so a
connection opened under a permissive policy is never reused by a strict one. The
environment's proxy (``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY``) is used only when the
operator trusts it (``DYN_MM_TRUST_EGRESS_PROXY=1``, :func:`.env.egress_proxy`): the URL
is still judged here, but the proxy resolves and connects on our behalf, so past it the
pinning is the proxy's to enforce. Otherwise fetches connect directly and the proxy
variables are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin

import penstock.http.env as env
import penstock.http.urls as urls
from penstock.errors import (
    HttpConnectionError,
    HttpError,
    HttpStatusError,
    HttpTimeoutError,
    UrlValidationError,
)
from penstock.http.decoding import decoded_chunks
from penstock.http.pinning import PIN, Pin, through_proxy
from penstock.http.urls import UrlValidationPolicy, describe_media_source

if TYPE_CHECKING:
    from penstock.settings import Settings

_MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
CHUNK_SIZE = 64 * 1024


@dataclass(frozen=True)
class HttpConfigBase:
    """Connection settings shared by the backends (``--http-*`` flags)."""

    max_connections: int = 100
    # Replaces every caller's total timeout when set.
    timeout: float | None = None
    connect_timeout: float = 5.0
    keepalive_timeout: float = 15.0
    # Checked at connect time when a fetch names no policy.
    policy: UrlValidationPolicy = field(default_factory=UrlValidationPolicy)
    user_agent: str = "penstock-media-fetch"

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpConfigBase:
        """The ``--http-*`` settings; the seed's ``DYN_HTTP_*`` variables where unset."""

        def read(field: str, variable: str, parse: Any) -> Any:
            return env.setting_or_env(settings, field, variable, parse)

        return cls(
            max_connections=read(
                "http_max_connections", "DYN_HTTP_MAX_CONNECTIONS", env.positive_int
            ),
            timeout=read("http_timeout_s", "DYN_HTTP_TIMEOUT", env.positive_float),
            connect_timeout=read(
                "http_connect_timeout_s", "DYN_HTTP_CONNECT_TIMEOUT", env.positive_float
            ),
            keepalive_timeout=read(
                "http_keepalive_timeout_s", "DYN_HTTP_KEEPALIVE_TIMEOUT", env.positive_float
            ),
            policy=UrlValidationPolicy.from_settings(settings),
        )

    def request_headers(self) -> dict[str, str]:
        # Media is compressed already; asking for identity keeps hosts from wrapping it.
        return {"user-agent": self.user_agent, "accept-encoding": "identity"}


@dataclass(frozen=True)
class BackendErrors:
    """Which of a backend's own exceptions mean a timeout, too many redirects or a bad URL;
    any other becomes :class:`HttpConnectionError`."""

    timeout: tuple[type[BaseException], ...]
    too_many_redirects: tuple[type[BaseException], ...]
    invalid_url: tuple[type[BaseException], ...]


@dataclass(frozen=True)
class RequestSpec:
    """One GET a backend sends, through the pool for ``pool_key``."""

    url: str
    pool_key: object
    follow_redirects: bool
    read_timeout: float | None
    # The trusted egress proxy to send it through; None: connect directly.
    proxy: str | None = None


@dataclass
class Response:
    """What a backend hands back: status, headers, and the body as chunks, exactly as
    they came (no ``Content-Encoding`` undone)."""

    status: int
    reason: str
    headers: dict[str, str]
    chunks: AsyncIterator[bytes]


class HttpClient(ABC):
    """Backend-neutral HTTP client.

    Subclasses own a backend-specific session/client on the instance. Callers use
    :meth:`fetch_bytes` and the unified exceptions of :mod:`penstock.errors`
    (``HttpError`` and its subclasses, ``UrlValidationError``); the backend's own
    exceptions never escape.
    """

    # Set by each backend, from its HTTP library's exception classes.
    _errors: BackendErrors
    # What a backend hands its library: redirects it may follow, the body's read size.
    max_redirects = _MAX_REDIRECTS
    chunk_size = CHUNK_SIZE

    def __init__(self, config: HttpConfigBase | None = None) -> None:
        self.config = config or HttpConfigBase()

    async def fetch_bytes(
        self,
        url: str,
        timeout: float,  # noqa: ASYNC109 (the seed signature)
        *,
        policy: UrlValidationPolicy | None = None,
        max_bytes: int | None = None,
        read_timeout: float | None = None,
    ) -> bytes:
        """Fetch ``url`` and return the response body.

        Single-shot: no retries. ``policy=None``: the backend follows redirects itself
        (every connection is still checked against the client's configured policy).
        ``policy`` set: redirects are followed here, each hop revalidated against the
        policy; :class:`UrlValidationError` when a hop fails or the chain is longer than
        ``_MAX_REDIRECTS``.
        """
        total = self.config.timeout if self.config.timeout is not None else timeout
        try:
            async with asyncio.timeout(total):
                if policy is None:
                    token = PIN.set(Pin(self.config.policy))
                    try:
                        return await self._fetch_once(url, max_bytes, read_timeout, None, True)
                    finally:
                        PIN.reset(token)
                return await self._fetch_checked(url, policy, max_bytes, read_timeout)
        except TimeoutError as exc:
            raise HttpTimeoutError(
                f"Fetching {describe_media_source(url)} took longer than {total:g}s"
            ) from exc

    async def _fetch_checked(
        self,
        url: str,
        policy: UrlValidationPolicy,
        max_bytes: int | None,
        read_timeout: float | None,
    ) -> bytes:
        chain = [url]
        while True:
            checked = await urls.check_url(url, policy)
            token = PIN.set(Pin(policy, checked.host, checked.addresses))
            try:
                body = await self._fetch_once(url, max_bytes, read_timeout, policy, False)
            finally:
                PIN.reset(token)
            if isinstance(body, bytes):
                return body
            if len(chain) > _MAX_REDIRECTS:
                hops = ", ".join(describe_media_source(hop) for hop in chain)
                raise UrlValidationError(
                    f"Too many redirects (max={_MAX_REDIRECTS}); chain=[{hops}]"
                )
            url = urljoin(url, body)
            chain.append(url)

    async def _fetch_once(
        self,
        url: str,
        max_bytes: int | None,
        read_timeout: float | None,
        policy: UrlValidationPolicy | None,
        follow_redirects: bool,
    ) -> Any:
        """The body, or (with redirects off) the ``Location`` of a redirect, a str."""
        proxy = env.egress_proxy(url)
        pool_key = ((policy or self.config.policy).network_key(), proxy)
        spec = RequestSpec(url, pool_key, follow_redirects, read_timeout, proxy)
        token = PIN.set(through_proxy(PIN.get(), proxy)) if proxy else None
        try:
            async with self._request(spec) as response:
                location = response.headers.get("location")
                if not follow_redirects and response.status in _REDIRECT_STATUSES and location:
                    return location
                if response.status >= 400:
                    raise HttpStatusError(response.status, response.reason, url)
                return await self._read_body(response, url, max_bytes)
        except (HttpError, UrlValidationError, TimeoutError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise self._translate(exc, url) from exc
        finally:
            if token is not None:
                PIN.reset(token)

    @staticmethod
    async def _read_body(response: Response, url: str, max_bytes: int | None) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in decoded_chunks(
            response.chunks, response.headers.get("content-encoding")
        ):
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise UrlValidationError(
                    f"Media exceeds the {max_bytes} byte download limit: "
                    f"{describe_media_source(url)}"
                )
            parts.append(chunk)
        return b"".join(parts)

    @abstractmethod
    def _request(self, spec: RequestSpec) -> contextlib.AbstractAsyncContextManager[Response]:
        """Send the GET ``spec`` describes; the body is read lazily, never decoded."""

    def _translate(self, exc: Exception, url: str) -> HttpError | UrlValidationError:
        """The unified exception for one of the backend's own."""
        label = describe_media_source(url)
        if isinstance(exc, self._errors.timeout):
            return HttpTimeoutError(f"Timed out fetching {label}: {type(exc).__name__}")
        if isinstance(exc, self._errors.too_many_redirects):
            return UrlValidationError(f"Too many redirects (max={_MAX_REDIRECTS}) fetching {label}")
        if isinstance(exc, self._errors.invalid_url):
            return UrlValidationError(f"Invalid URL {label}: {exc}")
        return HttpConnectionError(f"Could not fetch {label}: {type(exc).__name__}: {exc}")

    @abstractmethod
    async def close(self) -> None:
        """Close the backend session/client. Idempotent."""
