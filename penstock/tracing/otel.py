"""The OpenTelemetry side of tracing; imported only once tracing is on (needs the
``tracing`` extra: ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``).

Spans:

* one SERVER span per HTTP request (``/health``, ``/live`` and ``/metrics`` excepted),
  named ``METHOD /route/{template}``, whose parent is the incoming W3C ``traceparent``
  when it is valid (else a new trace). Attributes: ``http.*``, ``url.path``,
  ``penstock.request_id``, ``penstock.weight_version`` and, for chat and completions,
  ``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` /
  ``output_tokens``; admin operations add ``penstock.admin.operation``. 5xx and failures
  are errors; 4xx are not (the server did its job);
* one ``engine.generate`` child per engine request, with the attributes of Dynamo's span of
  that name (``model``, ``input_tokens``, ``output_tokens``, ``ttft_ms``,
  ``finish_reason``, ``cancelled``, ``error_kind``) and ``gen_ai.response.finish_reasons``;
  events ``admitted`` (a slot of ``--max-concurrency`` was granted) and ``first_token``.
  The engine's :class:`~penstock.engines.context.Context` carries this span: its
  ``trace_headers()`` name it as parent, and ``context.start_span`` makes children of it.

Spans are batched (``BatchSpanProcessor``, tuned by the standard ``OTEL_BSP_*``
variables) and flushed at shutdown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from penstock import __version__

AttributeValue = str | bool | int | float | Sequence[str]

_W3C = TraceContextTextMapPropagator()
_PROPAGATED = frozenset({b"traceparent", b"tracestate"})
# How an engine call ends when its consumer went away rather than the engine failing.
_CANCELLATIONS = (GeneratorExit, asyncio.CancelledError)
# ``gen_ai.operation.name`` of the serving endpoints.
_OPERATIONS = {"chat_completions": "chat", "completions": "text_completion"}


class _Choice(Protocol):
    @property
    def finish_reason(self) -> str | None: ...


class _Model(Protocol):
    @property
    def name(self) -> str: ...


class _EngineContext(Protocol):
    def use_span(
        self, span: Any, *, trace_id: str, span_id: str, parent_span_id: str | None, sampled: bool
    ) -> None: ...


class TracedGeneration(Protocol):
    """What an engine span reads of the serving layer's ``Generation``."""

    endpoint: str
    prompt_tokens: int
    weight_version: str | None

    @property
    def model(self) -> _Model: ...

    @property
    def context(self) -> _EngineContext: ...

    @property
    def choices(self) -> Sequence[_Choice]: ...

    @property
    def completion_tokens(self) -> int: ...


class Tracing:
    """The process's tracer provider, its OTLP/HTTP exporter and the spans it makes."""

    def __init__(self, *, endpoint: str | None, service_name: str) -> None:
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("penstock", __version__)

    def shutdown(self) -> None:
        self.provider.shutdown()

    def annotate(self, key: str, value: AttributeValue) -> None:
        trace.get_current_span().set_attribute(key, value)

    async def engine_call(
        self, stream: AsyncIterator[dict[str, Any]], generation: TracedGeneration
    ) -> AsyncIterator[dict[str, Any]]:
        """``stream`` (the host's ``generate``) inside an ``engine.generate`` span."""
        server = trace.get_current_span()
        model = generation.model.name
        operation = _OPERATIONS.get(generation.endpoint, generation.endpoint)
        server.set_attribute("gen_ai.operation.name", operation)
        server.set_attribute("gen_ai.request.model", model)
        span = self.tracer.start_span(
            "engine.generate",
            attributes={
                "model": model,
                "input_tokens": generation.prompt_tokens,
                "gen_ai.operation.name": operation,
            },
        )
        self._hand_to_engine(span, server, generation.context)
        started = time.perf_counter()
        waiting_first = True
        failure: BaseException | None = None
        try:
            async for chunk in stream:
                if waiting_first and chunk.get("token_ids"):
                    waiting_first = False
                    ttft_ms = (time.perf_counter() - started) * 1000
                    span.set_attribute("ttft_ms", ttft_ms)
                    span.add_event("first_token", {"ttft_ms": ttft_ms})
                yield chunk
        except BaseException as exc:
            failure = exc
            raise
        finally:
            try:
                await stream.aclose()  # type: ignore[attr-defined]
            finally:
                _end_engine_span(span, generation, failure)

    def _hand_to_engine(self, span: Span, parent: Span, context: _EngineContext) -> None:
        own = span.get_span_context()
        if not own.is_valid:
            return
        above = parent.get_span_context()
        context.use_span(
            EngineSpan(self.tracer, span, owned=False),
            trace_id=trace.format_trace_id(own.trace_id),
            span_id=trace.format_span_id(own.span_id),
            parent_span_id=trace.format_span_id(above.span_id) if above.is_valid else None,
            sampled=own.trace_flags.sampled,
        )


def _end_engine_span(
    span: Span, generation: TracedGeneration, failure: BaseException | None
) -> None:
    reasons = [choice.finish_reason for choice in generation.choices]
    finished = [reason for reason in reasons if reason is not None]
    span.set_attribute("output_tokens", generation.completion_tokens)
    span.set_attribute("gen_ai.response.finish_reasons", finished)
    if finished:
        span.set_attribute(
            "finish_reason", finished[0] if len(finished) == 1 else ",".join(finished)
        )
    if generation.weight_version is not None:
        span.set_attribute("penstock.weight_version", generation.weight_version)
    done = len(finished) == len(reasons)
    cancelled = not done and (failure is None or isinstance(failure, _CANCELLATIONS))
    span.set_attribute("cancelled", cancelled)
    if not done and not cancelled and failure is not None:
        kind = type(failure).__name__
        span.set_attribute("error_kind", kind)
        span.set_status(Status(StatusCode.ERROR, str(failure) or kind))
    span.end()


class EngineSpan:
    """A span as an engine sees it through ``Context.current_span`` / ``start_span``:
    Dynamo's ``SpanProxy``. The span the gateway opened for the engine call is not the
    engine's to close (``owned=False``); the children it starts are."""

    def __init__(self, tracer: trace.Tracer, span: Span, *, owned: bool) -> None:
        self._tracer = tracer
        self._span = span
        self._owned = owned

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        self._span.add_event(name, dict(attributes or {}))

    def set_status(self, status: str, description: str | None = None) -> None:
        code = StatusCode.ERROR if status == "error" else StatusCode.OK
        self._span.set_status(Status(code, description if code is StatusCode.ERROR else None))

    def start_span(
        self, name: str, attributes: Mapping[str, AttributeValue] | None = None
    ) -> EngineSpan:
        parent = trace.set_span_in_context(self._span)
        child = self._tracer.start_span(name, context=parent, attributes=dict(attributes or {}))
        return EngineSpan(self._tracer, child, owned=True)

    def close(self) -> None:
        if self._owned:
            self._span.end()

    def __enter__(self) -> EngineSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.set_status("error", f"{type(exc).__name__}: {exc}")
        self.close()


class TracingMiddleware:
    """The server span of every HTTP request but ``skip_paths``, current while the app
    handles it, so the engine and admin spans under it find their parent."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tracing: Tracing,
        skip_paths: frozenset[str],
        weight_version: Callable[[], str | None],
    ) -> None:
        self.app = app
        self.tracer = tracing.tracer
        self.skip_paths = skip_paths
        self.weight_version = weight_version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip_paths:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        parent = _W3C.extract(_trace_headers(scope))
        span = self.tracer.start_span(
            method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": scope["path"],
                "url.scheme": scope.get("scheme", "http"),
            },
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        status: int | None = None

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        failure: BaseException | None = None
        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            otel_context.detach(token)
            self._end(span, scope, status, failure)

    def _end(
        self, span: Span, scope: Scope, status: int | None, failure: BaseException | None
    ) -> None:
        route = getattr(scope.get("route"), "path", None)
        if route:
            span.update_name(f"{scope['method']} {route}")
            span.set_attribute("http.route", route)
        state = scope.get("state") or {}
        request_id = state.get("request_id")
        if request_id:
            span.set_attribute("penstock.request_id", request_id)
        usage = state.get("usage")
        if callable(usage):
            counts = usage()
            span.set_attribute("gen_ai.usage.input_tokens", counts["prompt_tokens"])
            span.set_attribute("gen_ai.usage.output_tokens", counts["completion_tokens"])
        version = self.weight_version()
        if version is not None:
            span.set_attribute("penstock.weight_version", version)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if failure is not None or status is None or status >= 500:
            kind = type(failure).__name__ if failure is not None else str(status or "incomplete")
            span.set_attribute("error.type", kind)
            span.set_status(Status(StatusCode.ERROR))
        span.end()


def _trace_headers(scope: Scope) -> dict[str, str]:
    """The propagation headers of a request, as the propagator reads them."""
    return {
        key.decode("latin-1"): value.decode("latin-1")
        for key, value in scope.get("headers", [])
        if key in _PROPAGATED
    }
