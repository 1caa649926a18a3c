"""What a video request may ask of a model, and the values it gets when it asks nothing.

An engine advertises its :class:`VideoLimits` in ``EngineConfig.runtime_data["media"]``
(see :meth:`VideoLimits.to_runtime_data`); the gateway reads them back and checks every
request before it becomes a job, so a bad request is a 400 at once, never a failed job
later. Engines that advertise nothing get the generic limits (any even size, any frame
count) and check the rest themselves.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from penstock.errors import MediaParamError, clip

RUNTIME_DATA_KEY = "media"

_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class VideoLimits:
    """A model's defaults and bounds for video (and image) requests.

    Valid frame counts are ``1 + k * frames_step`` up to ``max_num_frames`` (Wan's VAE
    compresses time by 4, so it takes 1, 5, 9, ...). Sizes must be multiples of
    ``size_multiple`` (always even: H.264 in yuv420p needs it).
    """

    default_size: str = "832x480"
    default_image_size: str = "512x512"
    default_fps: int = 24
    default_seconds: int = 4
    default_num_inference_steps: int = 50
    size_multiple: int = 2
    frames_step: int = 1
    max_num_frames: int = 1024
    max_fps: int = 120
    max_num_inference_steps: int = 1000
    accepts_input_reference: bool = False

    def to_runtime_data(self) -> dict[str, Any]:
        return {RUNTIME_DATA_KEY: asdict(self)}

    @classmethod
    def from_runtime_data(cls, runtime_data: dict[str, Any] | None) -> VideoLimits:
        advertised = (runtime_data or {}).get(RUNTIME_DATA_KEY) or {}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in advertised.items() if k in known})

    def valid_frame_counts(self) -> str:
        if self.frames_step == 1:
            return f"1 to {self.max_num_frames}"
        examples = ", ".join(str(1 + k * self.frames_step) for k in range(1, 4))
        return (
            f"1 + {self.frames_step}k between 1 and {self.max_num_frames} (e.g. 1, {examples}, ...)"
        )

    def is_valid_frame_count(self, frames: int) -> bool:
        return 1 <= frames <= self.max_num_frames and (frames - 1) % self.frames_step == 0

    def frames_for(self, seconds: float, fps: int) -> int:
        """The smallest valid frame count covering ``seconds`` at ``fps``."""
        wanted = max(1, math.ceil(seconds * fps))
        return 1 + math.ceil((wanted - 1) / self.frames_step) * self.frames_step


@dataclass(frozen=True)
class VideoPlan:
    """A video request with every value resolved and checked."""

    width: int
    height: int
    fps: int
    num_frames: int
    seconds: str
    num_inference_steps: int

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


def parse_size(
    value: str, *, param: str, multiple: int, max_width: int, max_height: int
) -> tuple[int, int]:
    """``"WxH"`` to ``(width, height)``, checked against the model and the server."""
    match = _SIZE_RE.match(value)
    if match is None:
        raise MediaParamError(
            param, f"'{clip(value)}' is not a size: use WIDTHxHEIGHT, e.g. 832x480"
        )
    width, height = int(match.group(1)), int(match.group(2))
    if width < 1 or height < 1:
        raise MediaParamError(param, f"'{clip(value)}': width and height must be positive")
    step = max(multiple, 2)
    if width % step or height % step:
        kind = "even" if step == 2 else f"multiples of {step}"
        raise MediaParamError(
            param, f"'{clip(value)}': width and height must be {kind} for this model"
        )
    if width > max_width or height > max_height:
        raise MediaParamError(
            param, f"'{clip(value)}' is larger than this server allows ({max_width}x{max_height})"
        )
    return width, height


def plan_video(
    *,
    size: str | None,
    seconds: int | None,
    fps: int | None,
    num_frames: int | None,
    num_inference_steps: int | None,
    limits: VideoLimits,
    max_width: int,
    max_height: int,
) -> VideoPlan:
    """Resolve defaults and check a video request; raises :class:`MediaParamError`."""
    width, height = parse_size(
        size or limits.default_size,
        param="size",
        multiple=limits.size_multiple,
        max_width=max_width,
        max_height=max_height,
    )
    fps = fps if fps is not None else limits.default_fps
    if not 1 <= fps <= limits.max_fps:
        raise MediaParamError("nvext.fps", f"{fps} is out of range: use 1 to {limits.max_fps}")
    if num_frames is not None:
        if not limits.is_valid_frame_count(num_frames):
            raise MediaParamError(
                "nvext.num_frames",
                f"{num_frames} is not valid for this model: use {limits.valid_frame_counts()}",
            )
        shown_seconds = f"{num_frames / fps:.3g}"
    else:
        asked = seconds if seconds is not None else limits.default_seconds
        longest = (limits.max_num_frames - 1) // fps
        if asked < 1 or limits.frames_for(asked, fps) > limits.max_num_frames:
            raise MediaParamError(
                "seconds",
                f"{asked} is out of range at {fps} fps: use 1 to {longest} "
                f"(this model makes at most {limits.max_num_frames} frames)"
                if longest >= 1
                else f"{asked} is out of range: at {fps} fps this model makes at most "
                f"{limits.max_num_frames} frames; lower nvext.fps or set nvext.num_frames",
            )
        num_frames = limits.frames_for(asked, fps)
        shown_seconds = str(asked)
    steps = (
        num_inference_steps
        if num_inference_steps is not None
        else limits.default_num_inference_steps
    )
    if not 1 <= steps <= limits.max_num_inference_steps:
        raise MediaParamError(
            "nvext.num_inference_steps",
            f"{steps} is out of range: use 1 to {limits.max_num_inference_steps}",
        )
    return VideoPlan(width, height, fps, num_frames, shown_seconds, steps)
