"""The seed's environment for media fetching, read where no Penstock setting is given.

A Dynamo deployment configures media fetches with ``DYN_MM_*`` and ``DYN_HTTP_*``
variables; they carry over to Penstock. A setting given as a flag or a ``PENSTOCK_*``
variable wins (it is in the settings' ``model_fields_set``); otherwise the seed's variable
is read, and a value it can't use is logged and replaced by the default, as upstream.

``DYN_MM_ALLOW_INTERNAL=1`` allows plain http and private addresses, ``DYN_MM_LOCAL_PATH``
one folder for local media, ``DYN_MM_MAX_FILE_SIZE_MB`` and ``DYN_MM_MAX_DATA_URL_MB`` the
two size limits; ``DYN_HTTP_MAX_CONNECTIONS``, ``DYN_HTTP_TIMEOUT``,
``DYN_HTTP_CONNECT_TIMEOUT`` and ``DYN_HTTP_KEEPALIVE_TIMEOUT`` the client (their older
``DYN_MM_HTTP_*`` names too, with a warning), ``DYN_HTTP_BACKEND`` its backend, and
``DYN_MM_TRUST_EGRESS_PROXY=1`` lets fetches go through the environment's proxy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from penstock.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The seed's earlier names, read when the current one is unset.
_LEGACY = {
    "DYN_HTTP_MAX_CONNECTIONS": "DYN_MM_HTTP_MAX_CONNECTIONS",
    "DYN_HTTP_TIMEOUT": "DYN_MM_HTTP_READ_TIMEOUT",
    "DYN_HTTP_CONNECT_TIMEOUT": "DYN_MM_HTTP_CONNECT_TIMEOUT",
}
_warned: set[str] = set()

MIB = 1024 * 1024


def read(variable: str) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    value = os.environ.get(variable, "").strip()
    legacy = _LEGACY.get(variable)
    if not value and legacy is not None:
        value = os.environ.get(legacy, "").strip()
        if value and legacy not in _warned:
            _warned.add(legacy)
            logger.warning("%s is deprecated: set %s instead", legacy, variable)
    return value or None


def flag(variable: str) -> bool:
    """True when the variable is ``1``, as the seed reads its switches."""
    return read(variable) == "1"


def positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def _parsed(variable: str, parse: Callable[[str], T], default: T) -> T:
    raw = read(variable)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        logger.warning("%s=%r can't be used (%s); using %s", variable, raw, exc, default)
        return default


def setting_or_env(
    settings: Settings, field: str, variable: str, parse: Callable[[str], Any]
) -> Any:
    """The setting ``field`` when it was given, else ``variable``, else the default."""
    value = getattr(settings, field)
    if field in settings.model_fields_set:
        return value
    return _parsed(variable, parse, value)


def given(settings: Settings, field: str) -> bool:
    return field in settings.model_fields_set


def fetch_max_bytes(settings: Settings) -> int:
    """The download limit: ``--media-fetch-max-mb``, else ``DYN_MM_MAX_FILE_SIZE_MB``."""
    mb = setting_or_env(settings, "media_fetch_max_mb", "DYN_MM_MAX_FILE_SIZE_MB", positive_float)
    return int(mb * MIB)


def data_url_max_bytes(settings: Settings) -> int:
    """The data URL limit: ``--media-max-data-url-mb``, else ``DYN_MM_MAX_DATA_URL_MB``."""
    mb = setting_or_env(settings, "media_max_data_url_mb", "DYN_MM_MAX_DATA_URL_MB", positive_float)
    return int(mb * MIB)


def http_backend(settings: Settings) -> str:
    """``--http-backend``, else ``DYN_HTTP_BACKEND`` (``aiohttp`` or ``httpx``)."""
    if given(settings, "http_backend"):
        return settings.http_backend
    raw = read("DYN_HTTP_BACKEND")
    if raw is None:
        return settings.http_backend
    if raw.lower() not in ("aiohttp", "httpx"):
        logger.warning(
            "DYN_HTTP_BACKEND=%r is not a backend (aiohttp, httpx); using %s",
            raw,
            settings.http_backend,
        )
        return settings.http_backend
    return raw.lower()


def egress_proxy(url: str) -> str | None:
    """The environment's proxy for ``url`` when ``DYN_MM_TRUST_EGRESS_PROXY=1`` and
    ``NO_PROXY`` doesn't exempt its host; None: connect directly."""
    if not flag("DYN_MM_TRUST_EGRESS_PROXY"):
        return None
    # urllib.request brings http.client, email and ssl: only servers that use a proxy pay.
    import urllib.request

    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme.lower())
    if not proxy or urllib.request.proxy_bypass_environment(parts.hostname or "", proxies):
        return None
    return proxy
