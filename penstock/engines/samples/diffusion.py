"""``sample-diffusion``: an image engine that needs no model, for trying the raw path.

Every image is the same valid 1x1 PNG; ``delay`` seconds pass before the answer (not for
health canaries). With ``--steps N`` that delay is split into N simulated denoising steps,
each reported as a progress object (``status`` ``in_progress``, ``progress``, ``step``,
``total_steps``) before the answer, as a real diffusion engine reports them; a request
cancelled meanwhile ends after the current step.

With ``--input-reference`` it advertises that it takes a reference image
(``accepts_input_reference``) and answers a request that carries one with that image
itself, so what the gateway fetched and decoded can be seen in the result.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np

from penstock.engines.builtin_options import SAMPLE_DIFFUSION
from penstock.engines.constants import ModelInput
from penstock.engines.context import Context
from penstock.engines.contract import (
    DiffusionEngine,
    EngineConfig,
    RawRequest,
    RawResponseChunk,
    WorkerConfig,
)
from penstock.engines.engine_options import engine_parser
from penstock.engines.health import (
    build_raw_health_check_payload,
    is_probe,
    parse_health_check_payload_cli,
)
from penstock.multimodal.encoding import data_url_bytes, encode_image
from penstock.multimodal.limits import VideoLimits

MAX_IMAGES = 10
_PIXEL_PNG_B64 = base64.b64encode(
    encode_image(np.full((1, 1, 3), 128, dtype=np.uint8), "png")
).decode()


def _parser() -> argparse.ArgumentParser:
    return engine_parser(SAMPLE_DIFFUSION)


def _image_count(request: RawRequest) -> int:
    raw = request.get("n", 1)
    if raw is None:
        return 1
    try:
        count = int(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError("`n` must be an integer") from exc
    if not 1 <= count <= MAX_IMAGES:
        raise ValueError(f"`n` must be between 1 and {MAX_IMAGES}")
    return count


class SampleDiffusionEngine(DiffusionEngine):
    """Answers ``n`` copies of a 1x1 PNG, as ``b64_json`` or a ``data:`` URL."""

    def __init__(
        self, model: str, *, delay: float = 0.05, steps: int = 0, input_reference: bool = False
    ) -> None:
        if delay < 0:
            raise ValueError("--delay must be >= 0")
        if steps < 0:
            raise ValueError("--steps must be >= 0")
        self.model = model
        self.delay = delay
        self.steps = steps
        self.input_reference = input_reference

    @classmethod
    async def from_args(
        cls, argv: list[str] | None = None
    ) -> tuple[SampleDiffusionEngine, WorkerConfig]:
        args = _parser().parse_args(argv)
        engine = cls(
            args.model, delay=args.delay, steps=args.steps, input_reference=args.input_reference
        )
        config = WorkerConfig(
            namespace=args.namespace,
            component=args.component,
            endpoint=args.endpoint,
            served_model_name=args.served_model_name or args.model,
            model_input=ModelInput.Text,
            endpoint_types=args.endpoint_types,
            enable_kv_routing=False,
            health_check_payload=parse_health_check_payload_cli(args.health_check_payload),
        )
        return engine, config

    async def start(self, worker_id: int) -> EngineConfig:
        runtime_data = (
            VideoLimits(accepts_input_reference=True).to_runtime_data()
            if self.input_reference
            else None
        )
        return EngineConfig(
            model=self.model, served_model_name=self.model, runtime_data=runtime_data
        )

    async def generate(
        self, request: RawRequest, context: Context
    ) -> AsyncGenerator[RawResponseChunk, None]:
        count = _image_count(request)
        response_format = request.get("response_format") or "url"
        if not is_probe(request):
            if self.steps:
                for step in range(1, self.steps + 1):
                    await asyncio.sleep(self.delay / self.steps)
                    if context.is_stopped():
                        return
                    yield {
                        "status": "in_progress",
                        "progress": step * 100 // (self.steps + 1),
                        "step": step,
                        "total_steps": self.steps,
                    }
            elif self.delay:
                await asyncio.sleep(self.delay)
        png_b64 = _PIXEL_PNG_B64
        reference = request.get("input_reference")
        if self.input_reference and isinstance(reference, str):
            # The gateway hands references over as base64 PNG data: URLs.
            png_b64 = reference.partition(",")[2] if data_url_bytes(reference) else png_b64
        if response_format == "b64_json":
            item = {"b64_json": png_b64}
        else:
            item = {"url": f"data:image/png;base64,{png_b64}"}
        yield {"created": int(time.time()), "data": [dict(item) for _ in range(count)]}

    async def health_check_payload(self) -> dict[str, Any] | None:
        return build_raw_health_check_payload(
            {"prompt": "ping", "n": 1, "response_format": "b64_json"}
        )

    async def cleanup(self) -> None:
        """Nothing to release."""
