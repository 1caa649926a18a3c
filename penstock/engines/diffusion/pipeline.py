"""One loaded diffusers pipeline and the calls the engine makes on it.

Everything here blocks and runs on the engine's single pipeline thread: a pipeline object
keeps per-call state (timesteps, guidance, interrupt flag), so calls never overlap.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
from diffusers import DiffusionPipeline, WanPipeline, WanVideoToVideoPipeline
from PIL import Image

from penstock.multimodal.limits import VideoLimits

StepCallback = Callable[[int, int], None]

DEFAULT_REFERENCE_STRENGTH = 0.8


class GenerationCancelled(Exception):
    """Raised between denoising steps when the request was cancelled."""


@dataclass(frozen=True)
class Generation:
    """What to generate: ``num_frames`` 1 with ``count`` > 1 is a batch of images."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_frames: int
    count: int
    num_inference_steps: int
    guidance_scale: float | None
    guidance_scale_2: float | None
    seed: int
    reference: Image.Image | None
    reference_strength: float


def pipeline_class_for(folder: Path) -> type[DiffusionPipeline]:
    """The pipeline class a diffusers folder names in its ``model_index.json``."""
    index = folder / "model_index.json"
    if not index.is_file():
        raise ValueError(f"{folder} is not a diffusers pipeline folder (no model_index.json)")
    name = json.loads(index.read_text()).get("_class_name", "")
    cls = getattr(diffusers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, DiffusionPipeline):
        raise ValueError(f"{folder}: unknown pipeline class '{name}'")
    return cls


def makes_video(cls: type[DiffusionPipeline]) -> bool:
    return "num_frames" in inspect.signature(cls.__call__).parameters


class LoadedPipeline:
    """A text-to-video or text-to-image pipeline, with what requests may ask of it."""

    def __init__(
        self,
        pipe: DiffusionPipeline,
        *,
        device: str,
        max_sequence_length: int | None,
        limits: VideoLimits,
    ) -> None:
        self.pipe = pipe
        self.device = device
        self.max_sequence_length = max_sequence_length
        self.parameters = set(inspect.signature(type(pipe).__call__).parameters)
        self.is_video = "num_frames" in self.parameters
        self.takes_image = "image" in self.parameters
        self.is_wan_text_to_video = isinstance(pipe, WanPipeline)
        self.has_second_transformer = getattr(pipe, "transformer_2", None) is not None
        self.limits = limits
        pipe.set_progress_bar_config(disable=True)

    @staticmethod
    def spatial_multiple(pipe: DiffusionPipeline) -> int:
        """Sizes must divide into whole latent patches."""
        scale = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(
            pipe, "vae_scale_factor", 8
        )
        transformer = getattr(pipe, "transformer", None)
        patch = getattr(getattr(transformer, "config", None), "patch_size", None)
        patch_hw = patch[-1] if isinstance(patch, list | tuple) else patch or 1
        return int(scale) * int(patch_hw)

    @staticmethod
    def temporal_step(pipe: DiffusionPipeline) -> int:
        return int(getattr(pipe, "vae_scale_factor_temporal", 1) or 1)

    @property
    def accepts_reference(self) -> bool:
        return self.takes_image or self.is_wan_text_to_video

    def run(
        self, job: Generation, on_step: StepCallback, should_stop: Callable[[], bool]
    ) -> np.ndarray:
        """Float frames in [0, 1]: ``(count, frames, H, W, 3)``."""

        def step_end(
            pipe: DiffusionPipeline, step: int, _timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            if should_stop():
                raise GenerationCancelled
            total = getattr(pipe, "_num_timesteps", None) or job.num_inference_steps
            on_step(step + 1, int(total))
            return tensors

        generator = torch.Generator(device="cpu").manual_seed(job.seed % 2**64)
        kwargs: dict[str, Any] = {
            "height": job.height,
            "width": job.width,
            "num_inference_steps": job.num_inference_steps,
            "generator": generator,
            "output_type": "np",
        }
        if "callback_on_step_end" in self.parameters:
            kwargs["callback_on_step_end"] = step_end
        if job.guidance_scale is not None:
            kwargs["guidance_scale"] = job.guidance_scale
        if job.guidance_scale_2 is not None:
            kwargs["guidance_scale_2"] = job.guidance_scale_2
        if self.max_sequence_length is not None and "max_sequence_length" in self.parameters:
            kwargs["max_sequence_length"] = self.max_sequence_length
        with torch.inference_mode():
            if self.is_video:
                return self._run_video(job, kwargs)
            return self._run_image(job, kwargs)

    def _run_video(self, job: Generation, kwargs: dict[str, Any]) -> np.ndarray:
        kwargs["num_videos_per_prompt"] = job.count
        if job.reference is not None and not self.takes_image:
            return self._run_wan_guided(job, kwargs)
        kwargs["prompt"] = job.prompt
        kwargs["negative_prompt"] = job.negative_prompt
        kwargs["num_frames"] = job.num_frames
        if job.reference is not None:
            kwargs["image"] = job.reference.resize((job.width, job.height))
        return np.asarray(self.pipe(**kwargs).frames)

    def _run_wan_guided(self, job: Generation, kwargs: dict[str, Any]) -> np.ndarray:
        """Text-to-video Wan guided by a reference image: video-to-video from a still clip.

        The prompt is encoded by the text-to-video pipeline (whose text cleaning has no
        optional dependencies) and handed over as embeddings.
        """
        pipe = self.pipe
        components = {
            name: module
            for name, module in pipe.components.items()
            if name in inspect.signature(WanVideoToVideoPipeline.__init__).parameters
        }
        guided = WanVideoToVideoPipeline(**components)
        guided.set_progress_bar_config(disable=True)
        guidance = kwargs.pop("guidance_scale", 5.0)
        prompt_embeds, negative_embeds = pipe.encode_prompt(
            prompt=job.prompt,
            negative_prompt=job.negative_prompt,
            do_classifier_free_guidance=guidance > 1.0,
            num_videos_per_prompt=job.count,
            max_sequence_length=kwargs.pop("max_sequence_length", 512),
            device=pipe._execution_device,
        )
        assert job.reference is not None
        still = job.reference.resize((job.width, job.height))
        kwargs.pop("num_videos_per_prompt")
        kwargs.pop("guidance_scale_2", None)
        frames = guided(
            video=[still] * job.num_frames,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_embeds,
            guidance_scale=guidance,
            strength=job.reference_strength,
            **kwargs,
        ).frames
        return np.asarray(frames)

    def _run_image(self, job: Generation, kwargs: dict[str, Any]) -> np.ndarray:
        if job.reference is not None:
            raise ValueError("input_reference: this model does not take a reference image")
        kwargs["prompt"] = job.prompt
        kwargs["negative_prompt"] = job.negative_prompt
        kwargs["num_images_per_prompt"] = job.count
        images = np.asarray(self.pipe(**kwargs).images)
        return images[:, None]
