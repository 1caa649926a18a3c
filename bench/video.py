"""Time video generation on the ``diffusion`` engine: denoising, encoding, whole request.

    .venv/bin/python bench/video.py                      # the tiny random-weight pipeline
    .venv/bin/python bench/video.py --model PATH --sizes 832x480 --frames 81 --steps 50

Prints one row per (size, frames): median seconds over ``--repeat`` runs of the full
engine request (steps + VAE decode + H.264 encode) and the seconds per denoising step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from penstock.engines.context import Context
from penstock.engines.diffusion import DiffusersEngine


async def one(engine: DiffusersEngine, size: str, frames: int, steps: int) -> tuple[float, float]:
    request = {
        "prompt": "a paper boat on a pond",
        "size": size,
        "response_format": "b64_json",
        "nvext": {"num_frames": frames, "num_inference_steps": steps, "seed": 0},
    }
    started = time.perf_counter()
    step_times: list[float] = []
    last = started
    async for chunk in engine.generate(request, Context()):
        if chunk.get("status") == "in_progress":
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
    return time.perf_counter() - started, statistics.median(step_times[1:] or step_times)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--sizes", default="64x64,128x128,256x256")
    parser.add_argument("--frames", default="9,17")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    engine, _ = await DiffusersEngine.from_args(["--model", args.model] if args.model else [])
    await engine.start(0)
    print(f"{'size':>10} {'frames':>6} {'request s':>10} {'step s':>8}")
    try:
        for size in args.sizes.split(","):
            for frames in (int(f) for f in args.frames.split(",")):
                await one(engine, size, frames, args.steps)
                runs = [await one(engine, size, frames, args.steps) for _ in range(args.repeat)]
                total = statistics.median(r[0] for r in runs)
                step = statistics.median(r[1] for r in runs)
                print(f"{size:>10} {frames:>6} {total:>10.3f} {step:>8.4f}")
    finally:
        await engine.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
