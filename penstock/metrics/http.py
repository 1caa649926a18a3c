"""HTTP-level metrics: ``prometheus-fastapi-instrumentator`` on the gateway's registry.

Labels are route templates (``/v1/videos/{video_id}``; ``none`` for a path no route
matches) and status classes (``2xx``), so raw paths never become series. ``/metrics``
itself is not counted.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp

EXCLUDED_HANDLERS = ("^/metrics$",)
INPROGRESS_NAME = "http_requests_inprogress"
# Route lookups remembered, by method and path; random paths only churn the oldest.
HANDLER_CACHE_SIZE = 1024


class HttpMetricsMiddleware(PrometheusInstrumentatorMiddleware):
    """The instrumentator's middleware with its in-progress gauge in ``registry``.

    The upstream middleware creates that gauge in the process-wide default registry,
    which would put it outside ``/metrics`` here and fail on a second app in one process.
    One middleware per registry: the app is built once per gateway. Route templates are
    looked up once per method and path (matching every route costs ~50 us a request).
    """

    def __init__(self, app: ASGIApp, *, registry: CollectorRegistry, **kwargs: Any) -> None:
        super().__init__(
            app,
            registry=registry,
            should_group_status_codes=True,
            should_ignore_untemplated=False,
            should_group_untemplated=True,
            should_instrument_requests_inprogress=False,
            excluded_handlers=EXCLUDED_HANDLERS,
            **kwargs,
        )
        self.should_instrument_requests_inprogress = True
        self.inprogress_labels = True
        self.inprogress = Gauge(
            INPROGRESS_NAME,
            "Number of HTTP requests in progress.",
            ["method", "handler"],
            registry=registry,
        )
        self._handlers: dict[tuple[str, str], tuple[str, bool]] = {}

    def _get_handler(self, request: Request) -> tuple[str, bool]:
        key = (request.scope["method"], request.scope["path"])
        found = self._handlers.get(key)
        if found is None:
            found = super()._get_handler(request)
            if len(self._handlers) >= HANDLER_CACHE_SIZE:
                del self._handlers[next(iter(self._handlers))]
            self._handlers[key] = found
        return found
