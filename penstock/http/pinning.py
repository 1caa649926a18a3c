"""Connections pinned to the addresses a fetch checked.

A fetch sets :data:`PIN` for the duration of one request; every backend's connect step
asks :func:`connect_addresses` where it may connect, so a host name is never resolved a
second time (DNS rebinding), and a fetch without a policy still has every address it
connects to checked against the client's configured one.
"""

from __future__ import annotations

import contextvars
import ipaddress
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import penstock.http.urls as urls
from penstock.errors import HttpConnectionError, UrlValidationError
from penstock.http.urls import UrlValidationPolicy


@dataclass(frozen=True)
class Pin:
    policy: UrlValidationPolicy
    host: str | None = None
    addresses: tuple[str, ...] = ()
    # The trusted egress proxy's host: the operator's own, so its address is not judged.
    proxy_host: str | None = None


def through_proxy(pin: Pin | None, proxy: str) -> Pin:
    """``pin`` for a request sent through the trusted ``proxy``."""
    host = (urlsplit(proxy).hostname or "").lower()
    if pin is None:
        return Pin(UrlValidationPolicy(), proxy_host=host)
    return replace(pin, proxy_host=host)


PIN: contextvars.ContextVar[Pin | None] = contextvars.ContextVar("penstock_http_pin", default=None)


async def connect_addresses(host: str, port: int, fallback: UrlValidationPolicy) -> list[str]:
    """The addresses a backend may connect to for ``host``: the pinned ones when the fetch
    checked this host, else those it resolves to, each checked against the policy."""
    pin = PIN.get()
    policy = pin.policy if pin is not None else fallback
    bare = host.strip("[]").lower()
    if pin is not None and pin.host is not None and pin.host.strip("[]") == bare:
        return list(pin.addresses)
    try:
        literal = ipaddress.ip_address(bare)
    except ValueError:
        literal = None
    if pin is not None and pin.proxy_host == bare:
        return [bare] if literal is not None else await _resolve_proxy(bare, port)
    if literal is None and (legacy := urls.legacy_ipv4(bare)) is not None:
        raise UrlValidationError(f"host {bare} is a non-canonical spelling of {legacy}")
    if literal is not None:
        if not policy.address_allowed(literal):
            raise HttpConnectionError(f"host {bare} is a blocked address")
        return [bare]
    if not policy.domain_allowed(bare.rstrip(".")):
        raise HttpConnectionError(f"host {bare} is not in the allowed media domains")
    try:
        addresses = await urls.resolve_host(bare, port)
    except OSError as exc:
        raise HttpConnectionError(f"Could not resolve host {bare}") from exc
    if not addresses or not all(policy.address_allowed(ipaddress.ip_address(a)) for a in addresses):
        raise HttpConnectionError(f"host {bare} resolves to blocked addresses")
    return addresses


async def _resolve_proxy(host: str, port: int) -> list[str]:
    try:
        return await urls.resolve_host(host, port)
    except OSError as exc:
        raise HttpConnectionError(f"Could not resolve the egress proxy {host}") from exc
