"""The aiohttp backend of :class:`~penstock.http.base.HttpClient` (``pip install
penstock[aiohttp]``; imported only when this client is built).

Connections are pinned in the connector's host lookup (``TCPConnector._resolve_host``,
the one step every connection of every redirect hop goes through, IP literals included):
it returns only the addresses :func:`~penstock.http.base.connect_addresses` allows. A
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
from penstock.http.base import (
    _MAX_REDIRECTS,
    CHUNK_SIZE,
    BackendErrors,
    HttpClient,
    HttpConfigBase,
    Response,
    connect_addresses,
)
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
                headers={"user-agent": config.user_agent},
                auto_decompress=True,
            )
            self._sessions[pool_key] = session
        return session

    @contextlib.asynccontextmanager
    async def _request(
        self,
        url: str,
        pool_key: object,
        follow_redirects: bool,
        read_timeout: float | None,
    ) -> AsyncIterator[Response]:
        aiohttp = self._aiohttp
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.connect_timeout, sock_read=read_timeout
        )
        session = self._session(pool_key)
        async with session.get(
            url,
            allow_redirects=follow_redirects,
            max_redirects=_MAX_REDIRECTS,
            timeout=timeout,
        ) as response:
            yield Response(
                response.status,
                response.reason or "",
                {k.lower(): v for k, v in response.headers.items()},
                response.content.iter_chunked(CHUNK_SIZE),
            )

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            await session.close()
