"""Traces a collector receives from a real ``penstock serve --otlp-endpoint``, and what
tracing costs when it is off (nothing imported) or misconfigured (one line)."""

from __future__ import annotations

import secrets
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import start_server
from tests.support.snippet import run_snippet

trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="the tracing extra is not installed",
)

CHAT = {"model": "sample-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SERVER, INTERNAL = 2, 1  # Span.SpanKind values in the OTLP protobuf


@dataclass
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[str]
    error: bool


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on a loopback port."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Receive)
        self.spans: list[Span] = []
        self.services: set[str] = set()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Receive(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource in request.resource_spans:
                for attribute in resource.resource.attributes:
                    if attribute.key == "service.name":
                        self.server.services.add(_value(attribute.value))
                for scope in resource.scope_spans:
                    self.server.spans += [
                        Span(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[event.name for event in span.events],
                            error=span.status.code == 2,
                        )
                        for span in scope.spans
                    ]
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@dataclass
class Traced:
    spans: list[Span]
    services: set[str]
    parents: dict[str, tuple[str, str]]  # label -> (trace id, span id) sent in traceparent
    log: str

    def server_span(self, label: str) -> Span:
        trace_id, _ = self.parents[label]
        [span] = [s for s in self.spans if s.kind == SERVER and s.trace_id == trace_id]
        return span

    def children(self, parent: Span) -> list[Span]:
        return [s for s in self.spans if s.parent_span_id == parent.span_id]


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    """One server: a chat request, a streamed one, an untraced one, pause and resume; then
    SIGTERM, so the spans still batched must be flushed at shutdown."""
    collector = Collector()
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    log_dir = tmp_path_factory.mktemp("tracing")
    server = start_server(
        [
            "--engine",
            "tests.tracing.engines:SpanningEngine",
            "--otlp-endpoint",
            collector.url,
            "--",
            "--delay",
            "0.001",
        ],
        log_dir,
        env={"OTEL_SERVICE_NAME": "rollouts"},
    )
    parents: dict[str, tuple[str, str]] = {}
    try:
        url = server.base_url
        trace_id, span_id, header = _traceparent()
        parents["chat"] = (trace_id, span_id)
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json=CHAT,
            headers={"traceparent": header, "x-request-id": "traced-1"},
        )
        assert response.status_code == 200
        trace_id, span_id, header = _traceparent()
        parents["stream"] = (trace_id, span_id)
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"traceparent": header},
        ) as streamed:
            assert streamed.status_code == 200
            assert list(streamed.iter_lines())[-2:] == ["data: [DONE]", ""]
        completion = {"model": "sample-model", "prompt": "x", "max_tokens": 4}
        untraced = httpx.post(f"{url}/v1/completions", json=completion)
        assert untraced.status_code == 200, untraced.text
        assert httpx.post(f"{url}/engine/pause_generation", json={"mode": "abort"}).is_success
        assert httpx.post(f"{url}/engine/resume_generation", json={}).is_success
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        server.stop(signal.SIGTERM)
        collector.shutdown()
        collector.server_close()
    yield Traced(collector.spans, collector.services, parents, server.log())


def test_the_server_span_continues_the_incoming_trace(traced: Traced) -> None:
    trace_id, parent_id = traced.parents["chat"]
    span = traced.server_span("chat")
    assert span.name == "POST /v1/chat/completions"
    assert span.parent_span_id == parent_id and span.trace_id == trace_id
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["penstock.request_id"] == "traced-1"
    assert span.attributes["gen_ai.operation.name"] == "chat"
    assert span.attributes["gen_ai.request.model"] == "sample-model"
    assert span.attributes["gen_ai.usage.input_tokens"] > 0
    assert span.attributes["gen_ai.usage.output_tokens"] == 4
    assert not span.error
    assert traced.services == {"rollouts"}


def test_the_engine_call_is_a_child_span(traced: Traced) -> None:
    for label in ("chat", "stream"):
        server = traced.server_span(label)
        [engine] = traced.children(server)
        assert engine.name == "engine.generate" and engine.kind == INTERNAL
        assert engine.trace_id == server.trace_id
        assert engine.events == ["admitted", "first_token"]
        assert engine.attributes["model"] == "sample-model"
        assert engine.attributes["output_tokens"] == 4
        assert engine.attributes["finish_reason"] == "length"
        assert engine.attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert engine.attributes["cancelled"] is False
        assert engine.attributes["ttft_ms"] > 0


def test_the_engine_is_handed_its_span(traced: Traced) -> None:
    server = traced.server_span("chat")
    [engine] = traced.children(server)
    [step] = traced.children(engine)
    assert step.name == "engine.step"
    assert step.attributes["seen.traceparent"] == f"00-{engine.trace_id}-{engine.span_id}-01"


def test_a_request_without_traceparent_starts_a_trace(traced: Traced) -> None:
    [span] = [s for s in traced.spans if s.name == "POST /v1/completions"]
    assert span.parent_span_id == ""
    assert span.trace_id not in {trace_id for trace_id, _ in traced.parents.values()}
    [engine] = traced.children(span)
    assert engine.name == "engine.generate"
    assert span.attributes["gen_ai.operation.name"] == "text_completion"


def test_admin_operations_get_a_span_each_and_probes_none(traced: Traced) -> None:
    admin = [s for s in traced.spans if s.attributes.get("url.path", "").startswith("/engine/")]
    assert {s.name for s in admin} == {"POST /engine/{name}"}
    operations = sorted(s.attributes["penstock.admin.operation"] for s in admin)
    assert operations == ["pause (mode abort)", "resume"]
    assert not [s for s in traced.spans if s.attributes.get("url.path") == "/health"]


def test_tracing_off_imports_nothing_of_opentelemetry() -> None:
    """FastAPI itself imports the OpenTelemetry API; a request served with tracing off adds
    no OpenTelemetry module to those, nor penstock's exporter side."""
    result = run_snippet(
        """
        import asyncio, sys
        import fastapi
        before = {m for m in sys.modules if m.startswith("opentelemetry")}
        from tests.support.inprocess import asgi_client, start_gateway

        async def main() -> None:
            gateway = await start_gateway()
            try:
                async for http in asgi_client(gateway):
                    body = {"model": "sample-model", "prompt": "hi", "max_tokens": 2}
                    assert (await http.post("/v1/completions", json=body)).status_code == 200
            finally:
                await gateway.host.cleanup()

        asyncio.run(main())
        added = {m for m in sys.modules if m.startswith("opentelemetry")} - before
        print(sorted(added), "penstock.tracing.otel" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] False"


def test_a_missing_tracing_extra_stops_the_start_in_one_line() -> None:
    result = run_snippet(
        """
        import sys
        sys.modules["opentelemetry.sdk"] = None  # as if opentelemetry-sdk were not installed
        from penstock.app.cli import main
        sys.exit(main(["serve", "--engine", "sample", "--otlp-endpoint", "http://127.0.0.1:9"]))
        """
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("penstock: error: tracing (--otlp-endpoint")
    assert line.endswith("which are not installed: pip install 'penstock[tracing]'")


def test_a_bad_endpoint_is_refused_naming_it(tmp_path: Path) -> None:
    result = run_snippet(
        """
        import sys
        from penstock.app.cli import main
        sys.exit(main(["serve", "--engine", "sample", "--otlp-endpoint", "collector:4318"]))
        """
    )
    assert result.returncode == 2
    assert "otlp_endpoint" in result.stderr and "http:// or https://" in result.stderr
