"""The aiohttp backend of :class:`~penstock.http.base.HttpClient` (``pip install
penstock[aiohttp]``; imported only when this client is built).

Connections are pinned in the connector's host lookup (``TCPConnector._resolve_host``,
the one step every connection of every redirect hop goes through, IP literals included):
it returns only the addresses :func:`~penstock.http.pinning.connect_addresses` allows. A
resolver plugged in through aiohttp's public API would not see IP literals, and a
request-start trace runs once per request, not per redirect hop; the fetch tests catch
a change of that private method.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

from penstock.errors import HttpConnectionError
from penstock.http.base import BackendErrors, HttpClient, HttpConfigBase, RequestSpec, Response
from penstock.http.pinning import connect_addresses
from penstock.http.urls import UrlValidationPolicy


def _aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError as exc:
        raise HttpConnectionError(
            "the aiohttp HTTP backend needs aiohttp: pip install 'penstock[aiohttp]'"
        ) from exc
    return aiohttp


def _pinned_connector(aiohttp: Any, fallback: UrlValidationPolicy, **kwargs: Any) -> Any:
    class PinnedConnector(aiohttp.TCPConnector):  # type: ignore[misc, name-defined]
        async def _resolve_host(
            self, host: str, port: int, traces: Any = None
        ) -> list[dict[str, Any]]:
            addresses = await connect_addresses(host, port, fallback)
            return [
                {
                    "hostname": host,
                    "host": address,
                    "port": port,
                    "family": socket.AF_INET6 if ":" in address else socket.AF_INET,
                    "proto": 0,
                    "flags": socket.AI_NUMERICHOST,
                }
                for address in addresses
            ]

    return PinnedConnector(**kwargs)


class AiohttpClient(HttpClient):
    """aiohttp-backed concrete client."""

    def __init__(self, config: HttpConfigBase | None = None) -> None:
        super().__init__(config)
        self._aiohttp = aiohttp = _aiohttp()
        self._errors = BackendErrors(
            timeout=(aiohttp.ServerTimeoutError, aiohttp.ConnectionTimeoutError),
            too_many_redirects=(aiohttp.TooManyRedirects,),
            invalid_url=(aiohttp.InvalidURL, ValueError),
        )
        self._sessions: dict[object, Any] = {}

    def _session(self, pool_key: object) -> Any:
        session = self._sessions.get(pool_key)
        if session is None or session.closed:
            aiohttp = self._aiohttp
            config = self.config
            connector = _pinned_connector(
                aiohttp,
                config.policy,
                limit=config.max_connections,
                limit_per_host=0,
                keepalive_timeout=config.keepalive_timeout,
                use_dns_cache=False,
            )
            session = aiohttp.ClientSession(
                connector=connector,
                trust_env=False,
                headers=config.request_headers(),
                auto_decompress=False,
            )
            self._sessions[pool_key] = session
        return session

    @contextlib.asynccontextmanager
    async def _request(self, spec: RequestSpec) -> AsyncIterator[Response]:
        timeout = self._aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.connect_timeout, sock_read=spec.read_timeout
        )
        async with self._session(spec.pool_key).get(
            spec.url,
            allow_redirects=spec.follow_redirects,
            proxy=spec.proxy,
            max_redirects=self.max_redirects,
            timeout=timeout,
        ) as response:
            yield Response(
                response.status,
                response.reason or "",
                {k.lower(): ", ".join(response.headers.getall(k)) for k in response.headers},
                response.content.iter_chunked(self.chunk_size),
            )

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            await session.close()
