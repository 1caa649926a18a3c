"""``diffusion``: video and image generation on a local diffusers pipeline.

``--model PATH`` loads any local diffusers text-to-video pipeline (the Wan family at
least) or text-to-image pipeline. Without a model, a tiny random-weight Wan pipeline is
built from config (about a second on a CPU, nothing downloaded), so
``penstock serve --engine diffusion`` works offline.

Requests are the raw OpenAI-shaped bodies: a video request (``extra_args.endpoint_type``
``"videos"``, the default) yields one progress object per denoising step, then the
terminal ``NvVideosResponse``-shaped object with one H.264 MP4; an image request
(``"images"``) yields one ``NvImagesResponse``-shaped object. The pipeline runs on one
dedicated thread, one request at a time (a pipeline holds per-call state); the event loop
keeps serving meanwhile, and progress comes back through ``call_soon_threadsafe``. A
stopped context ends the run at the next step boundary.

Defaults and limits are advertised in ``EngineConfig.runtime_data`` (see
:class:`penstock.multimodal.limits.VideoLimits`) so the gateway can reject what this pipeline
can't make before a job is queued.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from penstock.engines import controls
from penstock.engines.builtin_options import DIFFUSION
from penstock.engines.constants import ModelInput
from penstock.engines.context import Context
from penstock.engines.contract import (
    DiffusionEngine,
    EngineConfig,
    RawRequest,
    RawResponseChunk,
    WorkerConfig,
)
from penstock.engines.controls import Body, ControlTable, Handler
from penstock.engines.diffusion.pipeline import (
    DEFAULT_REFERENCE_STRENGTH,
    Generation,
    GenerationCancelled,
    LoadedPipeline,
    makes_video,
    pipeline_class_for,
)
from penstock.engines.diffusion.tiny import TINY_MAX_SEQUENCE_LENGTH, build_tiny_wan_pipeline
from penstock.engines.engine_options import engine_parser
from penstock.engines.health import (
    build_raw_health_check_payload,
    parse_health_check_payload_cli,
)
from penstock.multimodal.encoding import (
    UndecodableImage,
    data_url_bytes,
    decode_image,
    encode_image,
    encode_mp4,
    to_uint8,
)
from penstock.multimodal.limits import VideoLimits, parse_size, plan_video
from penstock.schemas.media_passthrough import ENDPOINT_TYPE_KEY, sanitize_media_passthrough

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "tiny-wan"
MAX_IMAGES = 10
IMAGE_FORMATS = ("png", "webp", "jpeg")
# The operator's maximum size is the gateway's to enforce; here only the pipeline's rules.
_UNCAPPED = 1 << 16
_TINY_LIMITS = VideoLimits(
    default_size="128x128",
    default_image_size="128x128",
    default_fps=8,
    default_seconds=2,
    default_num_inference_steps=4,
    max_num_frames=257,
)
_MODEL_LIMITS = VideoLimits(max_num_frames=257)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    return engine_parser(DIFFUSION)


def _limit_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {
        "default_size": args.default_size,
        "default_image_size": args.default_image_size,
        "default_fps": args.default_fps,
        "default_seconds": args.default_seconds,
        "default_num_inference_steps": args.default_steps,
        "max_num_frames": args.max_num_frames,
    }
    return {key: value for key, value in overrides.items() if value is not None}


class DiffusersEngine(ControlTable, DiffusionEngine):
    def __init__(
        self,
        model: str | None,
        *,
        name: str,
        device: str | None = None,
        dtype: str | None = None,
        seed: int = 0,
        limit_overrides: dict[str, Any] | None = None,
        max_sequence_length: int | None = None,
    ) -> None:
        self.model_path = Path(model) if model else None
        self.name = name
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = _DTYPES[dtype] if dtype else None
        self.seed = seed
        self.limit_overrides = dict(limit_overrides or {})
        self.max_sequence_length = max_sequence_length
        self.pipeline: LoadedPipeline | None = None
        self._executor: ThreadPoolExecutor | None = None
        # The requests in generate: what abort_request ends.
        self._in_flight: set[Context] = set()

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[DiffusersEngine, WorkerConfig]:
        parser = _parser()
        args = parser.parse_args(argv)
        endpoint_types = args.endpoint_types
        if args.model:
            folder = Path(args.model)
            try:
                pipeline_cls = pipeline_class_for(folder)
            except ValueError as exc:
                parser.error(f"--model: {exc}")
            name = args.model_name or folder.name
            if endpoint_types is None:
                endpoint_types = "videos,images" if makes_video(pipeline_cls) else "images"
        else:
            name = args.model_name or TINY_MODEL_NAME
            endpoint_types = endpoint_types or "videos,images"
        engine = cls(
            args.model,
            name=name,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            limit_overrides=_limit_overrides(args),
            max_sequence_length=args.max_sequence_length,
        )
        config = WorkerConfig(
            namespace="penstock",
            component="diffusion",
            served_model_name=args.served_model_name or name,
            model_input=ModelInput.Text,
            endpoint_types=endpoint_types,
            enable_kv_routing=False,
            health_check_payload=parse_health_check_payload_cli(args.health_check_payload),
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion")
        loop = asyncio.get_running_loop()
        self.pipeline = await loop.run_in_executor(self._executor, self._load)
        return EngineConfig(
            model=self.name,
            served_model_name=self.name,
            runtime_data=self.pipeline.limits.to_runtime_data(),
        )

    def _load(self) -> LoadedPipeline:
        if self.model_path is None:
            pipe = build_tiny_wan_pipeline(self.seed)
            base = _TINY_LIMITS
            max_sequence_length = self.max_sequence_length or TINY_MAX_SEQUENCE_LENGTH
        else:
            pipeline_cls = pipeline_class_for(self.model_path)
            dtype = self.dtype or (torch.float32 if self.device == "cpu" else torch.bfloat16)
            pipe = pipeline_cls.from_pretrained(self.model_path, dtype=dtype)
            base = _MODEL_LIMITS
            max_sequence_length = self.max_sequence_length
        pipe.to(self.device)
        probe = LoadedPipeline(
            pipe, device=self.device, max_sequence_length=max_sequence_length, limits=base
        )
        limits = replace(
            base,
            size_multiple=LoadedPipeline.spatial_multiple(pipe),
            frames_step=LoadedPipeline.temporal_step(pipe) if probe.is_video else 1,
            max_num_frames=base.max_num_frames if probe.is_video else 1,
            accepts_input_reference=probe.accepts_reference,
            **self.limit_overrides,
        )
        probe.limits = limits
        return probe

    async def cleanup(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        self.pipeline = None

    async def health_check_payload(self) -> dict[str, Any] | None:
        if self.pipeline is None:
            return None
        side = self.pipeline.limits.size_multiple
        return build_raw_health_check_payload(
            {
                "prompt": "ping",
                "n": 1,
                "size": f"{side}x{side}",
                "response_format": "b64_json",
                "nvext": {"num_inference_steps": 1, "seed": 0},
                "extra_args": {ENDPOINT_TYPE_KEY: "images"},
            }
        )

    # -- requests -------------------------------------------------------------------

    def control_handlers(self) -> dict[str, Handler]:
        return {controls.ABORT_REQUEST: self._abort_request}

    async def _abort_request(self, body: Body) -> Body:
        """Stops the named runs (or all) at their next denoising step; they end failed."""
        wanted = controls.parse_abort(body)
        ended = [c for c in self._in_flight if not c.is_stopped() and wanted.matches(c.id())]
        for context in ended:
            context.stop_generating()
        return controls.aborted({c.id() for c in ended})

    async def generate(
        self, request: RawRequest, context: Context
    ) -> AsyncGenerator[RawResponseChunk, None]:
        self._in_flight.add(context)
        try:
            async with contextlib.aclosing(self._generate(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._in_flight.discard(context)

    async def _generate(
        self, request: RawRequest, context: Context
    ) -> AsyncGenerator[RawResponseChunk, None]:
        if self.pipeline is None or self._executor is None:
            raise RuntimeError("engine not started")
        extra_args = request.get("extra_args") or {}
        knobs = sanitize_media_passthrough(extra_args)
        if extra_args.get(ENDPOINT_TYPE_KEY) == "images":
            job, image_format = self._image_job(request, knobs)
            images = None
            async for chunk in self._run(job, context, progress=False):
                images = chunk
            if isinstance(images, np.ndarray):
                yield await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._image_response, request, job, images, image_format
                )
            return
        job, fps = self._video_job(request, knobs)
        created = int(time.time())
        started = time.monotonic()
        frames = None
        async for chunk in self._run(job, context, progress=True):
            if isinstance(chunk, np.ndarray):
                frames = chunk
                continue
            step, total = chunk
            yield {
                "id": context.id(),
                "object": "video",
                "model": self.name,
                "status": "in_progress",
                "progress": min(99, step * 100 // max(total, 1)),
                "created": created,
                "data": [],
                "step": step,
                "total_steps": total,
            }
        if frames is None:
            yield {
                "id": context.id(),
                "object": "video",
                "model": self.name,
                "status": "failed",
                "progress": 0,
                "created": created,
                "error": "cancelled",
            }
            return
        loop = asyncio.get_running_loop()
        video = await loop.run_in_executor(self._executor, encode_mp4, to_uint8(frames[0]), fps)
        encoded = base64.b64encode(video).decode()
        item: dict[str, Any] = {"output_format": "mp4", "fps": fps}
        if request.get("response_format") == "b64_json":
            item["b64_json"] = encoded
        else:
            item["url"] = f"data:video/mp4;base64,{encoded}"
        yield {
            "id": context.id(),
            "object": "video",
            "model": self.name,
            "status": "completed",
            "progress": 100,
            "created": created,
            "data": [item],
            "inference_time_s": round(time.monotonic() - started, 3),
        }

    async def _run(
        self, job: Generation, context: Context, *, progress: bool
    ) -> AsyncGenerator[tuple[int, int] | np.ndarray, None]:
        """Run ``job`` on the pipeline thread; yields ``(step, total)`` then the frames.

        Ends without frames when the context was stopped. If the consumer goes away the
        pipeline stops at its next step.
        """
        assert self._executor is not None and self.pipeline is not None
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        abandoned = False

        def on_step(step: int, total: int) -> None:
            if progress:
                loop.call_soon_threadsafe(steps.put_nowait, (step, total))

        def should_stop() -> bool:
            return abandoned or context.is_stopped()

        pipeline = self.pipeline
        future = loop.run_in_executor(self._executor, pipeline.run, job, on_step, should_stop)
        try:
            while not future.done() or not steps.empty():
                getter = asyncio.ensure_future(steps.get())
                await asyncio.wait({getter, future}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            try:
                frames = future.result()
            except GenerationCancelled:
                return
            yield frames
        finally:
            abandoned = True

    # -- request parsing --------------------------------------------------------------

    def _common(self, request: RawRequest, knobs: dict[str, Any]) -> dict[str, Any]:
        assert self.pipeline is not None
        prompt = request.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt: a non-empty prompt is required")
        nvext = request.get("nvext") or {}
        seed = nvext.get("seed")
        reference = None
        if request.get("input_reference"):
            if not self.pipeline.limits.accepts_input_reference:
                raise ValueError("input_reference: this model does not take a reference image")
            data = data_url_bytes(str(request["input_reference"]))
            if data is None:
                raise ValueError("input_reference: expected a base64 data: URL")
            try:
                reference = decode_image(data)
            except UndecodableImage as exc:
                raise ValueError(f"input_reference: {exc}") from exc
        try:
            # Multipart forms carry passthrough values as text.
            strength = float(knobs.get("strength", DEFAULT_REFERENCE_STRENGTH))
        except (TypeError, ValueError):
            strength = -1.0
        if not 0.0 < strength <= 1.0:
            raise ValueError("strength: must be a number in (0, 1]")
        guidance_2 = nvext.get("guidance_scale_2")
        if guidance_2 is not None and not self.pipeline.has_second_transformer:
            raise ValueError(
                "nvext.guidance_scale_2: this model has one transformer; it applies to "
                "two-stage (Wan 2.2) pipelines only"
            )
        if nvext.get("boundary_ratio") is not None:
            raise ValueError(
                "nvext.boundary_ratio: not adjustable per request here; the model's config sets it"
            )
        return {
            "prompt": prompt,
            "negative_prompt": nvext.get("negative_prompt"),
            "guidance_scale": nvext.get("guidance_scale"),
            "guidance_scale_2": guidance_2,
            "seed": int(seed) if seed is not None else secrets.randbits(63),
            "reference": reference,
            "reference_strength": strength,
        }

    def _video_job(self, request: RawRequest, knobs: dict[str, Any]) -> tuple[Generation, int]:
        assert self.pipeline is not None
        limits = self.pipeline.limits
        if not self.pipeline.is_video:
            raise ValueError(f"model '{self.name}' makes images only")
        output_format = request.get("output_format")
        if output_format not in (None, "mp4"):
            raise ValueError(f"output_format: '{output_format}' is not supported: use mp4")
        nvext = request.get("nvext") or {}
        plan = plan_video(
            size=request.get("size"),
            seconds=request.get("seconds"),
            fps=nvext.get("fps"),
            num_frames=nvext.get("num_frames"),
            num_inference_steps=nvext.get("num_inference_steps"),
            limits=limits,
            max_width=_UNCAPPED,
            max_height=_UNCAPPED,
        )
        job = Generation(
            width=plan.width,
            height=plan.height,
            num_frames=plan.num_frames,
            count=1,
            num_inference_steps=plan.num_inference_steps,
            **self._common(request, knobs),
        )
        return job, plan.fps

    def _image_job(self, request: RawRequest, knobs: dict[str, Any]) -> tuple[Generation, str]:
        assert self.pipeline is not None
        limits = self.pipeline.limits
        count = request.get("n") or 1
        if not isinstance(count, int) or not 1 <= count <= MAX_IMAGES:
            raise ValueError(f"n: must be an integer between 1 and {MAX_IMAGES}")
        width, height = parse_size(
            request.get("size") or limits.default_image_size,
            param="size",
            multiple=limits.size_multiple,
            max_width=_UNCAPPED,
            max_height=_UNCAPPED,
        )
        image_format = str(knobs.get("output_format") or "png").lower()
        if image_format == "jpg":
            image_format = "jpeg"
        if image_format not in IMAGE_FORMATS:
            raise ValueError(
                f"output_format: '{image_format}' is not supported: use {', '.join(IMAGE_FORMATS)}"
            )
        steps = (request.get("nvext") or {}).get("num_inference_steps")
        steps = steps if steps is not None else limits.default_num_inference_steps
        if not isinstance(steps, int) or not 1 <= steps <= limits.max_num_inference_steps:
            raise ValueError(
                f"nvext.num_inference_steps: use 1 to {limits.max_num_inference_steps}"
            )
        job = Generation(
            width=width,
            height=height,
            num_frames=1,
            count=count,
            num_inference_steps=steps,
            **self._common(request, knobs),
        )
        return job, image_format

    def _image_response(
        self, request: RawRequest, job: Generation, frames: np.ndarray, image_format: str
    ) -> dict[str, Any]:
        mime = f"image/{image_format}"
        data = []
        for clip in to_uint8(frames):
            encoded = base64.b64encode(encode_image(clip[0], image_format)).decode()
            if request.get("response_format") == "b64_json":
                data.append({"b64_json": encoded})
            else:
                data.append({"url": f"data:{mime};base64,{encoded}"})
        return {
            "created": int(time.time()),
            "data": data,
            "output_format": image_format,
            "size": f"{job.width}x{job.height}",
        }
