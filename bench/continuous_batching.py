"""Continuous batching vs one-at-a-time on a tiny random Llama: aggregate tokens/s.

Runs 16 requests of 128 tokens each twice through the transformers engine: one after
another, then all at once. The engine must deliver at least 4x the aggregate tokens/s
when they share the batch.

    .venv/bin/python bench/continuous_batching.py [--requests 16] [--tokens 128] [--cpu-threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from tests.support.tiny_llm import build_tiny_llama

REQUIRED_SPEEDUP = 4.0


def request(index: int, tokens: int) -> dict:
    return {
        "token_ids": [10 + index, 11 + index, 12 + index, 13 + index],
        "sampling_options": {"temperature": 1.0, "seed": index},
        "stop_conditions": {"max_tokens": tokens, "ignore_eos": True},
    }


async def generate(engine: TransformersEngine, index: int, tokens: int) -> int:
    produced = 0
    async for chunk in engine.generate(request(index, tokens), Context(f"bench-{index}")):
        produced += len(chunk["token_ids"])
    return produced


async def measure(
    requests: int, tokens: int, model_dir: Path, engine_args: list[str]
) -> tuple[float, float]:
    engine, _ = await TransformersEngine.from_args(
        ["--model", str(model_dir), "--max-num-seqs", str(requests), *engine_args]
    )
    await engine.start(0)
    try:
        await generate(engine, 0, 8)  # warm-up
        started = time.perf_counter()
        produced = 0
        for index in range(requests):
            produced += await generate(engine, index, tokens)
        sequential = produced / (time.perf_counter() - started)
        started = time.perf_counter()
        counts = await asyncio.gather(*(generate(engine, i, tokens) for i in range(requests)))
        concurrent = sum(counts) / (time.perf_counter() - started)
    finally:
        await engine.cleanup()
    return sequential, concurrent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--cpu-threads", help="passed to the engine (default: torch's choice)")
    args = parser.parse_args()
    engine_args = ["--cpu-threads", args.cpu_threads] if args.cpu_threads else []
    with tempfile.TemporaryDirectory() as folder:
        model_dir = build_tiny_llama(Path(folder) / "tiny-llama")
        sequential, concurrent = asyncio.run(
            measure(args.requests, args.tokens, model_dir, engine_args)
        )
    speedup = concurrent / sequential
    print(f"requests x tokens     : {args.requests} x {args.tokens}")
    print(f"one at a time         : {sequential:8.0f} tokens/s")
    print(f"all at once (batched) : {concurrent:8.0f} tokens/s")
    print(f"speedup               : {speedup:8.2f}x (required >= {REQUIRED_SPEEDUP:g}x)")
    return 0 if speedup >= REQUIRED_SPEEDUP else 1


if __name__ == "__main__":
    raise SystemExit(main())
