"""Video generation through the ``diffusion`` engine beside the same diffusers pipeline
called directly: denoising step time, whole job time, and the engine's overhead in %.

    .venv/bin/python bench/video.py                      # the tiny random-weight pipeline
    .venv/bin/python bench/video.py --model PATH --sizes 832x480 --frames 81 --steps 50

One row per (size, frames), medians over ``--repeat`` runs alternating between the two:
the engine request (request parsing, the pipeline thread, per-step progress, H.264
encode, base64) and a direct ``pipe(...)`` call on the engine's own pipeline object with
the same arguments (no encode); the MP4 encode alone is shown so the overhead can be
split. Seconds per denoising step exclude the first step (text encoding lands in it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from penstock.engines.context import Context
from penstock.engines.diffusion import DiffusersEngine
from penstock.multimodal.encoding import encode_mp4, to_uint8


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


def direct(engine: DiffusersEngine, size: str, frames: int, steps: int) -> tuple[float, float]:
    """(pipeline seconds, median seconds per step) of the diffusers pipeline called alone."""
    assert engine.pipeline is not None
    loaded = engine.pipeline
    width, height = (int(v) for v in size.split("x"))
    marks: list[float] = []

    def step_end(_pipe: object, _step: int, _timestep: object, tensors: dict) -> dict:
        marks.append(time.perf_counter())
        return tensors

    kwargs: dict = {
        "prompt": "a paper boat on a pond",
        "height": height,
        "width": width,
        "num_frames": frames,
        "num_inference_steps": steps,
        "generator": torch.Generator(device="cpu").manual_seed(0),
        "output_type": "np",
        "callback_on_step_end": step_end,
    }
    if loaded.max_sequence_length is not None:
        kwargs["max_sequence_length"] = loaded.max_sequence_length
    started = time.perf_counter()
    with torch.inference_mode():
        loaded.pipe(**kwargs)
    total = time.perf_counter() - started
    gaps = [b - a for a, b in zip([started, *marks], marks, strict=False)]
    return total, statistics.median(gaps[1:] or gaps)


def encode_seconds(size: str, frames: int) -> float:
    width, height = (int(v) for v in size.split("x"))
    clip = to_uint8(torch.rand(frames, height, width, 3).numpy())
    started = time.perf_counter()
    encode_mp4(clip, 16)
    return time.perf_counter() - started


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
    header = (
        f"{'size':>10} {'frames':>6} {'engine s':>9} {'direct s':>9} {'overhead':>9} "
        f"{'encode s':>9} {'engine step s':>14} {'direct step s':>14}"
    )
    print(header)
    try:
        for size in args.sizes.split(","):
            for frames in (int(f) for f in args.frames.split(",")):
                await one(engine, size, frames, args.steps)
                engine_runs, direct_runs = [], []
                for _ in range(args.repeat):
                    engine_runs.append(await one(engine, size, frames, args.steps))
                    direct_runs.append(direct(engine, size, frames, args.steps))
                total = statistics.median(r[0] for r in engine_runs)
                alone = statistics.median(r[0] for r in direct_runs)
                step = statistics.median(r[1] for r in engine_runs)
                alone_step = statistics.median(r[1] for r in direct_runs)
                encode = encode_seconds(size, frames)
                overhead = 100 * (total - alone) / alone
                print(
                    f"{size:>10} {frames:>6} {total:>9.3f} {alone:>9.3f} {overhead:>8.1f}% "
                    f"{encode:>9.3f} {step:>14.4f} {alone_step:>14.4f}",
                    flush=True,
                )
    finally:
        await engine.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
