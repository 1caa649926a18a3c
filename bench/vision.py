"""Image inputs of the transformers engine on the tiny LLaVA checkpoint: what an image
costs the first time, what it costs once its features are cached.

For each image size: ``encode`` is the processor and the vision tower on a new image
(``VisionEncoder.prepare`` on a cache miss: hash, resize, tower, projector); ``hit`` is
``prepare`` for the same image again (hash and cache lookup only); then the time to the
first token of a chat-sized prompt with a new image vs with the cached one.

    .venv/bin/python bench/vision.py [--repeats 20] [--cpu-threads 1]
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

from PIL import Image

from penstock.engines.context import Context
from penstock.engines.transformers import TransformersEngine
from tests.support.tiny_vlm import build_tiny_vlm

SIZES = ((64, 64), (512, 512), (1920, 1080))


def image(size: tuple[int, int]) -> Image.Image:
    """Random pixels: every call is a new image to the content-hash cache."""
    return Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3))


async def ttft_ms(engine: TransformersEngine, picture: Image.Image) -> float:
    assert engine.vision is not None
    prompt = [5, 6, engine.vision.image_token_id, *range(10, 40)]
    request = {
        "token_ids": prompt,
        "multi_modal_data": {"image_url": [{"Decoded": picture}]},
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
    }
    started = time.perf_counter()
    async for _ in engine.generate(request, Context()):
        break
    return (time.perf_counter() - started) * 1e3


async def main(repeats: int, cpu_threads: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        model_dir = build_tiny_vlm(Path(folder))
        engine, _ = await TransformersEngine.from_args(
            ["--model", str(model_dir), "--cpu-threads", str(cpu_threads)]
        )
        await engine.start(0)
        vision = engine.vision
        assert vision is not None
        print(
            "| image | encode ms (p50) | cache hit ms (p50) | TTFT new image ms | TTFT cached ms |"
        )
        print("|---|---|---|---|---|")
        try:
            prompt = [5, vision.image_token_id, 6]
            for size in SIZES:
                misses, hits = [], []
                for _ in range(repeats):
                    data = {"image_url": [{"Decoded": image(size)}]}
                    started = time.perf_counter()
                    await vision.prepare(prompt, data)
                    misses.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    await vision.prepare(prompt, data)
                    hits.append(time.perf_counter() - started)
                picture = image(size)
                cold = statistics.median([await ttft_ms(engine, image(size)) for _ in range(5)])
                await ttft_ms(engine, picture)
                warm = statistics.median([await ttft_ms(engine, picture) for _ in range(5)])
                print(
                    f"| {size[0]}x{size[1]} | {statistics.median(misses) * 1e3:.2f} "
                    f"| {statistics.median(hits) * 1e3:.3f} | {cold:.2f} | {warm:.2f} |"
                )
        finally:
            await engine.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cpu-threads", type=int, default=1)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.repeats, arguments.cpu_threads))
