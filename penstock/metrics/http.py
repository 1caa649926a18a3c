"""HTTP-level metrics: the series of ``prometheus-fastapi-instrumentator``'s default
instrumentation, on the gateway's registry.

Labels are route templates (``/v1/videos/{video_id}``; ``none`` for a path no route
matches) and status classes (``2xx``), so raw paths never become series. ``/metrics``
itself is not counted. The families, their labels and buckets are the instrumentator's:
``http_requests_total`` (method, status, handler), ``http_request_size_bytes`` and
``http_response_size_bytes`` (handler; the Content-Length headers, 0 without one),
``http_request_duration_highr_seconds`` (no labels), ``http_request_duration_seconds``
(method, handler) and the ``http_requests_inprogress`` gauge (method, handler).

The upstream middleware builds a request, a response and an info object per request and
looks up every labelled child each time, about a tenth of a short request's CPU; this one
keeps the children it used, by label values, takes the route lookup from the
instrumentator once per method and path, and updates plain children
(:mod:`penstock.metrics.plain`).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator.routing import get_route_name
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from penstock.metrics.plain import PlainFamilies

EXCLUDED_HANDLERS = frozenset({"/metrics"})
INPROGRESS_NAME = "http_requests_inprogress"
# Route lookups remembered, by method and path; random paths only churn the oldest.
HANDLER_CACHE_SIZE = 1024
LATENCY_HIGHR_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5,
    10, 30, 60,
)  # fmt: skip
LATENCY_LOWR_BUCKETS = (0.1, 0.5, 1)


def _content_length(headers: Any) -> int:
    for key, value in headers:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


class HttpMetricsMiddleware:
    """Counts every HTTP request but ``/metrics`` into ``registry``; one per registry (the
    app is built once per gateway)."""

    def __init__(self, app: ASGIApp, *, registry: CollectorRegistry) -> None:
        self.app = app
        families = PlainFamilies()
        self.total = families.counter(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
        )
        self.in_size = families.summary(
            "http_request_size_bytes",
            "Content length of incoming requests by handler. Only value of header is "
            "respected. Otherwise ignored. No percentile calculated. ",
            ["handler"],
        )
        self.out_size = families.summary(
            "http_response_size_bytes",
            "Content length of outgoing responses by handler. Only value of header is "
            "respected. Otherwise ignored. No percentile calculated. ",
            ["handler"],
        )
        self.latency_highr = families.histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate "
            "percentile calculations. ",
            buckets=LATENCY_HIGHR_BUCKETS,
        ).labels()
        self.latency = families.histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation "
            "by handler is important. ",
            ["method", "handler"],
            buckets=LATENCY_LOWR_BUCKETS,
        )
        self.inprogress = families.gauge(
            INPROGRESS_NAME,
            "Number of HTTP requests in progress.",
            ["method", "handler"],
        )
        registry.register(families)
        self._handlers: dict[tuple[str, str], str | None] = {}

    def _handler(self, scope: Scope) -> str | None:
        """The route template (``none`` when no route matches), None for excluded paths."""
        key = (scope["method"], scope["path"])
        try:
            return self._handlers[key]
        except KeyError:
            pass
        name = get_route_name(Request(scope), should_include_root_path=False)
        handler = None if (name or scope["path"]) in EXCLUDED_HANDLERS else name or "none"
        if len(self._handlers) >= HANDLER_CACHE_SIZE:
            del self._handlers[next(iter(self._handlers))]
        self._handlers[key] = handler
        return handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = self._handler(scope)
        if handler is None:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method = scope["method"]
        inprogress = self.inprogress.labels(method, handler)
        inprogress.inc()
        response = _ResponseStart(send)
        try:
            await self.app(scope, receive, response.send)
        finally:
            duration = max(time.perf_counter() - started, 0.0)
            inprogress.dec()
            status_class = f"{str(int(response.status))[0]}xx"
            self.total.labels(method, status_class, handler).inc()
            self.in_size.labels(handler).observe(_content_length(scope["headers"]))
            self.out_size.labels(handler).observe(response.size)
            self.latency_highr.observe(duration)
            self.latency.labels(method, handler).observe(duration)


class _ResponseStart:
    """The status and Content-Length a request's response began with, seen on its way to
    ``send`` (an object, not a closure with cells: an open stream holds it)."""

    __slots__ = ("server_send", "size", "status")

    def __init__(self, send: Send) -> None:
        self.server_send = send
        self.status = 500
        self.size = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.size = _content_length(message.get("headers", ()))
        await self.server_send(message)
