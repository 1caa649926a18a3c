"""Wire models of video generation: ``NvCreateVideoRequest`` in, ``NvVideosResponse`` out.

The request is what ``POST /v1/videos`` and ``POST /v1/videos/generations`` accept and
what a raw engine receives (after the gateway resolved defaults). Top-level fields the
model does not declare are kept and travel to the engine under
``extra_args["media_passthrough"]`` once the sanitiser accepted them. ``extra_args`` itself
is filled by the gateway only: a client-sent ``extra_args`` is an unknown field like any
other (and the sanitiser refuses it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from penstock.schemas.media_passthrough import nest_passthrough
from penstock.schemas.unicode import JSONValue, RequestModel

# A name no JSON client sends, so ``extra_args`` is never read from a request body.
_GATEWAY_ONLY_ALIAS = "\x00extra_args"


class VideoNvExt(RequestModel):
    """Generation knobs beyond the OpenAI request."""

    model_config = ConfigDict(extra="forbid")

    annotations: list[str] | None = None
    fps: int | None = Field(default=None, ge=1)
    num_frames: int | None = Field(default=None, ge=1)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    boundary_ratio: float | None = None
    guidance_scale_2: float | None = None


class NvCreateVideoRequest(RequestModel):
    """A video generation request (``size`` is ``WxH``; ``nvext.num_frames`` beats
    ``seconds`` x ``nvext.fps``)."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    extra_args: dict[str, Any] | None = Field(default=None, validation_alias=_GATEWAY_ONLY_ALIAS)
    prompt: str
    model: str
    input_reference: str | None = None
    seconds: int | None = None
    size: str | None = None
    user: str | None = None
    response_format: Literal["url", "b64_json"] | None = None
    output_format: str | None = None
    stream: bool | None = None
    nvext: VideoNvExt | None = None

    @property
    def unknown_fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def to_engine_request(self) -> dict[str, Any]:
        """The JSON object a raw engine receives; unknown fields nested and screened.

        Raises :class:`~penstock.schemas.media_passthrough.MediaPassthroughRejected`.
        """
        body = self.model_dump(exclude_none=True, exclude=set(self.unknown_fields))
        extra_args = nest_passthrough(self.extra_args, self.unknown_fields)
        if extra_args is not None:
            body["extra_args"] = extra_args
        return body


class VideoData(BaseModel):
    """One generated video: ``output_format`` is the container actually produced."""

    output_format: str
    url: str | None = None
    b64_json: str | None = None
    fps: int | None = None
    audio_sample_rate: int | None = None


class NvVideosResponse(BaseModel):
    """The terminal answer of a video generation (and the shape of progress objects)."""

    id: str
    object: str = "video"
    model: str
    status: str = "completed"
    progress: int = 100
    created: int
    data: list[VideoData] = Field(default_factory=list)
    error: str | None = None
    inference_time_s: float | None = None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
