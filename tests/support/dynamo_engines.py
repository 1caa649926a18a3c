"""Engines written against Dynamo's own ``dynamo.common.backend`` (needs the ai-dynamo
wheels): Dynamo's ``SampleLLMEngine`` as an engine author would extend it."""

from __future__ import annotations

import argparse
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from dynamo.common.backend import WorkerConfig
from dynamo.common.backend.metrics import register_engine_registry
from dynamo.common.backend.sample_engine import SampleLLMEngine
from dynamo.llm.exceptions import HttpError, InvalidArgument
from prometheus_client import CollectorRegistry, Counter


class InstrumentedSampleEngine(SampleLLMEngine):
    """Dynamo's sample engine plus a vendor Prometheus registry bridged the documented way,
    typed errors for some inputs, and each ``abort`` written to ``--abort-log``."""

    abort_log: Path
    registry: CollectorRegistry
    requests: Counter

    @classmethod
    async def from_args(
        cls, argv: list[str] | None = None
    ) -> tuple[InstrumentedSampleEngine, WorkerConfig]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--abort-log", required=True)
        own, rest = parser.parse_known_args(argv)
        engine, config = await SampleLLMEngine.from_args(rest)
        engine.__class__ = cls
        engine.abort_log = Path(own.abort_log)
        engine.registry = CollectorRegistry()
        engine.requests = Counter(
            "sample_vendor:requests", "Requests the vendor engine saw", registry=engine.registry
        )
        return engine, config  # type: ignore[return-value]

    async def register_prometheus(self, metrics: Any) -> None:
        register_engine_registry(metrics, self.registry, prefix_filters=["sample_vendor:"])

    async def abort(self, context: Any) -> None:
        with self.abort_log.open("a") as log:
            log.write(f"{context.id()}\n")

    async def generate(self, request: Any, context: Any) -> AsyncGenerator[Any, None]:
        self.requests.inc()
        temperature = (request.get("sampling_options") or {}).get("temperature")
        if temperature is not None and temperature > 1.5:
            raise InvalidArgument("temperature above 1.5 is not supported by this engine")
        if (request.get("stop_conditions") or {}).get("max_tokens") == 13:
            raise HttpError(422, "max_tokens=13 is unlucky")
        async for chunk in super().generate(request, context):
            yield chunk
