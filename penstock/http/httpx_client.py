"""The httpx backend of :class:`~penstock.http.base.HttpClient`.

Connections are pinned by wrapping httpcore's network backend: its ``connect_tcp`` gets
the host name of the URL and connects to an address from
:func:`~penstock.http.pinning.connect_addresses` instead; TLS is then started by httpcore
with the host name, so certificates are still checked against it.

httpx is imported with the first fetch, not with the server: it brings httpcore, h11, and
(through its command line) rich and pygments, about 5 MB that most servers never use.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from penstock.errors import HttpConnectionError
from penstock.http.base import BackendErrors, HttpClient, HttpConfigBase, RequestSpec, Response
from penstock.http.pinning import connect_addresses
from penstock.http.urls import UrlValidationPolicy

if TYPE_CHECKING:
    import httpcore
    import httpx


@functools.cache
def _library_errors() -> BackendErrors:
    import httpx

    return BackendErrors(
        timeout=(httpx.TimeoutException,),
        too_many_redirects=(httpx.TooManyRedirects,),
        invalid_url=(httpx.InvalidURL, httpx.UnsupportedProtocol),
    )


class _PinnedBackend:
    """An ``httpcore.AsyncNetworkBackend`` (httpcore calls these three methods only)."""

    def __init__(self, fallback: UrlValidationPolicy) -> None:
        import httpcore

        self._inner = httpcore.AnyIOBackend()
        self._fallback = fallback

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore signature)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        import httpcore

        addresses = await connect_addresses(host, port, self._fallback)
        last: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise HttpConnectionError("unix sockets are not used for media fetches")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class HttpxClient(HttpClient):
    """httpx-backed concrete client."""

    def __init__(self, config: HttpConfigBase | None = None) -> None:
        super().__init__(config)
        self._clients: dict[object, httpx.AsyncClient] = {}

    @property  # type: ignore[override]
    def _errors(self) -> BackendErrors:
        return _library_errors()

    def _client(self, pool_key: object, proxy: str | None) -> httpx.AsyncClient:
        client = self._clients.get(pool_key)
        if client is None:
            import httpx

            config = self.config
            limits = httpx.Limits(
                max_connections=config.max_connections,
                keepalive_expiry=config.keepalive_timeout,
            )
            transport = httpx.AsyncHTTPTransport(limits=limits, trust_env=False, proxy=proxy)
            # httpx has no public way to hand its pool a network backend.
            transport._pool._network_backend = _PinnedBackend(config.policy)
            client = httpx.AsyncClient(
                transport=transport,
                trust_env=False,
                max_redirects=self.max_redirects,
                headers=config.request_headers(),
            )
            self._clients[pool_key] = client
        return client

    @contextlib.asynccontextmanager
    async def _request(self, spec: RequestSpec) -> AsyncIterator[Response]:
        import httpx

        timeout = httpx.Timeout(None, connect=self.config.connect_timeout, read=spec.read_timeout)
        client = self._client(spec.pool_key, spec.proxy)
        request = client.build_request("GET", spec.url, timeout=timeout)
        response = await client.send(request, stream=True, follow_redirects=spec.follow_redirects)
        try:
            yield Response(
                response.status_code,
                response.reason_phrase,
                {k.lower(): v for k, v in response.headers.items()},
                response.aiter_raw(self.chunk_size),
            )
        finally:
            await response.aclose()

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()
