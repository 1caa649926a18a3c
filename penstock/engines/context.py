"""Per-request context handed to an engine: identity, cancellation, metadata and the W3C
trace context it propagates (``traceparent`` / ``tracestate``).

When the gateway traces (``--otlp-endpoint``), the context carries the ``engine.generate``
span of its request: ``trace_headers()`` name it as the parent, ``current_span()`` returns
it and ``start_span()`` opens children of it. Otherwise both return a span that does
nothing, so engines can call them unconditionally."""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol

_TRACEPARENT_VERSION = "00"


@functools.cache
def tracing_enabled() -> bool:
    """Read once per process: a context is made per request, and a lookup of a variable
    that isn't set costs a few microseconds each time."""
    return os.environ.get("OTEL_EXPORT_ENABLED", "").strip().lower() in {"1", "true", "yes", "on"}


def _parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        int(parts[1], 16)
        int(parts[2], 16)
    except ValueError:
        return None
    return parts[1], parts[2], parts[3]


class SpanProxy(Protocol):
    """A span as an engine sees it (Dynamo's ``SpanProxy``); a context manager that
    closes the span, marking it an error when the block raised."""

    def set_attribute(self, key: str, value: Any) -> None: ...

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None: ...

    def set_status(self, status: str, description: str | None = None) -> None:
        """``status``: ``"ok"`` or ``"error"``."""

    def start_span(self, name: str, attributes: Mapping[str, Any] | None = None) -> SpanProxy:
        """A child of this span, to ``close()`` (or use as a context manager)."""

    def close(self) -> None: ...

    def __enter__(self) -> SpanProxy: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...


class _NoSpan:
    """The span of a request that is not traced: every call does nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def set_status(self, status: str, description: str | None = None) -> None:
        return None

    def start_span(self, name: str, attributes: Mapping[str, Any] | None = None) -> SpanProxy:
        return self

    def close(self) -> None:
        return None

    def __enter__(self) -> SpanProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None


NO_SPAN: SpanProxy = _NoSpan()


API_KEY_METADATA = "x-api-key-digest"
"""The metadata entry holding a digest of the caller's API key (the key itself never
reaches an engine), on servers that check keys: what an engine shares out per caller."""


class Context:
    """Identity, cancellation and metadata of one in-flight request.

    Stop is graceful (the engine should finish with ``finish_reason="cancelled"`` and the
    gateway keeps draining what it yields); kill means the client is gone. Both are
    observable from any thread through :meth:`is_stopped` / :meth:`is_killed`.
    """

    def __init__(
        self,
        id: str | None = None,
        metadata: Mapping[str, str] | None = None,
        *,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> None:
        self._id = id or str(uuid.uuid4())
        self._metadata: dict[str, str] = dict(metadata or {})
        self._stopped = False
        self._killed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._first_token = False
        self._tracestate = tracestate
        self._span = NO_SPAN
        parsed = _parse_traceparent(traceparent)
        if parsed is not None:
            self.trace_id: str | None = parsed[0]
            self.parent_span_id: str | None = parsed[1]
            self._trace_flags = parsed[2]
            self.span_id: str | None = secrets.token_hex(8)
        elif tracing_enabled():
            self.trace_id = secrets.token_hex(16)
            self.parent_span_id = None
            self._trace_flags = "01"
            self.span_id = secrets.token_hex(8)
        else:
            self.trace_id = None
            self.parent_span_id = None
            self._trace_flags = "00"
            self.span_id = None

    def id(self) -> str:
        return self._id

    @property
    def metadata(self) -> dict[str, str]:
        return self._metadata

    @metadata.setter
    def metadata(self, value: Mapping[str, str]) -> None:
        self._metadata = dict(value)

    def is_stopped(self) -> bool:
        return self._stopped

    def is_killed(self) -> bool:
        return self._killed

    def stop_generating(self) -> None:
        """Ask the engine to finish gracefully; output already produced stays valid."""
        self._stopped = True
        self._wake()

    def kill(self) -> None:
        """Mark the request as abandoned (client gone); implies stopped."""
        self._killed = True
        self._stopped = True
        self._wake()

    def _wake(self) -> None:
        if self._event is None or self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._event.set()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._event.set)

    async def async_killed_or_stopped(self) -> bool:
        """Resolve (True) once the request is stopped or killed."""
        if self._stopped:
            return True
        if self._event is None:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
            if self._stopped:
                self._event.set()
        await self._event.wait()
        return True

    def detached(self, id: str | None = None) -> Context:
        """A fresh context (own cancellation, new id) keeping trace parentage and metadata."""
        child = Context(id, dict(self._metadata), tracestate=self._tracestate)
        child.trace_id = self.trace_id
        child.parent_span_id = self.span_id
        child._trace_flags = self._trace_flags
        child.span_id = secrets.token_hex(8) if self.trace_id else None
        child._span = self._span
        return child

    def current_span(self) -> SpanProxy:
        """The span of this request's engine call (one that does nothing if untraced)."""
        return self._span

    def start_span(self, name: str, attributes: Mapping[str, Any] | None = None) -> SpanProxy:
        """A child of :meth:`current_span`; close it (or use it as a context manager)."""
        return self._span.start_span(name, attributes)

    def use_span(
        self,
        span: SpanProxy,
        *,
        trace_id: str,
        span_id: str,
        parent_span_id: str | None,
        sampled: bool,
    ) -> None:
        """Make ``span`` (hex ids given) the one this context carries and propagates."""
        self._span = span
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self._trace_flags = "01" if sampled else "00"

    def notify_first_token(self) -> None:
        self._first_token = True

    @property
    def first_token_seen(self) -> bool:
        return self._first_token

    def trace_headers(self) -> dict[str, str] | None:
        if self.trace_id is None or self.span_id is None:
            return None
        traceparent = "-".join(
            (_TRACEPARENT_VERSION, self.trace_id, self.span_id, self._trace_flags)
        )
        headers = {"traceparent": traceparent}
        if self._tracestate:
            headers["tracestate"] = self._tracestate
        request_id = self._metadata.get("x-request-id")
        if request_id:
            headers["x-request-id"] = request_id
            headers["request-id"] = request_id
        return headers
