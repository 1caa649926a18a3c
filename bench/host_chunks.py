"""µs per chunk the engine host adds between an engine's generator and its consumer.

A zero-delay engine yields ``--tokens`` chunks per request; the script times
``EngineHost.generate`` over ``--requests`` sequential requests and prints µs per chunk,
so two builds of ``penstock/engines/host.py`` can be compared (run it from each tree).
With ``--cancel-safe`` the engine advertises ``CANCEL_SAFE_RUNTIME_KEY`` and the host
drives it from the consumer's task.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    EngineConfig,
    LLMEngine,
    WorkerConfig,
)
from penstock.engines.host import EngineHost


class _Instant(LLMEngine):
    def __init__(self, tokens: int, cancel_safe: bool = False) -> None:
        self.tokens = tokens
        self.cancel_safe = cancel_safe

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[_Instant, WorkerConfig]:
        return cls(64), WorkerConfig(namespace="bench")

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(
            model="instant", runtime_data={CANCEL_SAFE_RUNTIME_KEY: self.cancel_safe}
        )

    async def cleanup(self) -> None:
        pass

    async def generate(
        self, request: dict[str, Any], context: Context
    ) -> AsyncGenerator[dict[str, Any], None]:
        for i in range(self.tokens - 1):
            yield {"token_ids": [i], "index": 0}
        yield {"token_ids": [0], "index": 0, "finish_reason": "length"}


async def _run(tokens: int, requests: int, cancel_safe: bool) -> float:
    host = EngineHost(_Instant(tokens, cancel_safe), WorkerConfig(namespace="bench"))
    await host.start()
    started = time.perf_counter()
    for _ in range(requests):
        async for _chunk in host.generate({"token_ids": [1]}, Context()):
            pass
    elapsed = time.perf_counter() - started
    await host.cleanup()
    return elapsed / (tokens * requests) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--cancel-safe", action="store_true")
    args = parser.parse_args()
    print(f"{asyncio.run(_run(args.tokens, args.requests, args.cancel_safe)):.2f} µs/chunk")


if __name__ == "__main__":
    main()
