"""A pooling engine that takes ``--pool-delay`` seconds a request, so a request's deadline
can pass while the engine works; it writes each abort to ``--marker``."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from penstock.engines.context import Context
from penstock.engines.contract import EngineConfig, GenerateChunk, GenerateRequest, WorkerConfig
from penstock.engines.pooling import POOLING_RUNTIME_KEY, PoolingCapabilities
from penstock.engines.samples.engine import SampleLLMEngine

DIMENSIONS = 4


class SlowPoolingEngine(SampleLLMEngine):
    pool_delay: float
    marker: Path

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[Any, WorkerConfig]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--pool-delay", type=float, required=True)
        parser.add_argument("--marker", type=Path, required=True)
        own, rest = parser.parse_known_args(argv)
        engine, config = await SampleLLMEngine.from_args(rest)
        engine.__class__ = cls
        engine.pool_delay = own.pool_delay
        engine.marker = own.marker
        config.endpoint_types = "embeddings"
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        config = await super().start(worker_id)
        capabilities = PoolingCapabilities(frozenset({"embed", "classify"}), DIMENSIONS, ("a", "b"))
        config.runtime_data[POOLING_RUNTIME_KEY] = capabilities.advertise()
        return config

    async def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        await asyncio.sleep(self.pool_delay)
        inputs: list[Any] = request.get("token_ids") or []
        width = DIMENSIONS if request.get("pooling_task") == "embed" else 2
        chunk: dict[str, Any] = {
            "token_ids": [],
            "index": 0,
            "finish_reason": "stop",
            "embeddings": [[1.0] + [0.0] * (width - 1) for _ in inputs],
            "prompt_tokens": sum(len(ids) for ids in inputs),
        }
        yield chunk  # type: ignore[misc]

    async def abort(self, context: Context) -> None:
        await super().abort(context)
        with self.marker.open("a") as file:
            file.write(f"abort {context.id()}\n")
