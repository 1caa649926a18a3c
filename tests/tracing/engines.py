"""An engine that uses its request's span the way Dynamo engines do."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from penstock.engines.context import Context
from penstock.engines.contract import GenerateChunk, GenerateRequest
from penstock.engines.samples.engine import SampleLLMEngine


class SpanningEngine(SampleLLMEngine):
    """The sample engine, generating inside a child span that records the
    ``traceparent`` the engine was handed."""

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[Any, Any]:
        engine, config = await SampleLLMEngine.from_args(argv)
        engine.__class__ = cls
        return engine, config

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        headers = context.trace_headers() or {}
        with context.start_span(
            "engine.step", {"seen.traceparent": headers.get("traceparent", "")}
        ):
            async for chunk in super().generate(request, context):
                yield chunk
