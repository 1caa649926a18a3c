"""Traces over OTLP/HTTP, off unless an endpoint is configured.

``--otlp-endpoint`` (``PENSTOCK_OTLP_ENDPOINT``), or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, turns tracing on:
:func:`install` then builds the exporter (:mod:`penstock.tracing.otel`, which needs the
``tracing`` extra) and every HTTP request but the probes gets a server span, each engine
call a child ``engine.generate`` span (:mod:`penstock.tracing.otel` says what they carry).

Off, this module is all that is imported: no OpenTelemetry SDK, no exporter, and the
serving path only checks :func:`active` once per engine call. The composition root
installs one tracer per process and shuts it down (flushing what is batched) at exit.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from penstock.errors import TracingSetupError
from penstock.settings import Settings

if TYPE_CHECKING:
    from penstock.tracing.otel import Tracing

DEFAULT_SERVICE_NAME = "penstock"
TRACES_PATH = "/v1/traces"
INSTALL_HINT = "pip install 'penstock[tracing]'"
# The standard variables the OpenTelemetry exporter reads itself.
STANDARD_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_active: Tracing | None = None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (``/v1/traces`` appended unless
    it is there already), as ``OTEL_EXPORTER_OTLP_ENDPOINT`` is read."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def enabled(settings: Settings) -> bool:
    return bool(settings.otlp_endpoint) or any(
        os.environ.get(name, "").strip() for name in STANDARD_ENDPOINT_ENV
    )


def service_name(settings: Settings) -> str:
    return (
        settings.otlp_service_name
        or os.environ.get("OTEL_SERVICE_NAME", "").strip()
        or DEFAULT_SERVICE_NAME
    )


def install(settings: Settings) -> Tracing | None:
    """Start exporting spans when an endpoint is configured; None (and nothing imported)
    otherwise. Raises :class:`TracingSetupError` when the ``tracing`` extra is missing."""
    global _active
    if not enabled(settings):
        return None
    try:
        from penstock.tracing.otel import Tracing
    except ImportError:
        raise TracingSetupError(
            "tracing (--otlp-endpoint or OTEL_EXPORTER_OTLP_*ENDPOINT) needs OpenTelemetry's "
            f"SDK and OTLP/HTTP exporter, which are not installed: {INSTALL_HINT}"
        ) from None
    # None lets the exporter read the standard variables itself.
    endpoint = traces_url(settings.otlp_endpoint) if settings.otlp_endpoint else None
    _active = Tracing(endpoint=endpoint, service_name=service_name(settings))
    return _active


def shutdown() -> None:
    """Export what is still batched and stop tracing."""
    global _active
    tracing, _active = _active, None
    if tracing is not None:
        tracing.shutdown()


def active() -> Tracing | None:
    """The process's tracer while tracing is on."""
    return _active


def annotate(key: str, value: str | int | float | bool) -> None:
    """Set an attribute on the span of the request being served, when tracing is on."""
    if _active is not None:
        _active.annotate(key, value)
