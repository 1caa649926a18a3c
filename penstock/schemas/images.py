"""Wire models of image generation: ``NvCreateImageRequest`` in, ``NvImagesResponse`` out.

As for video, undeclared top-level fields travel to the engine under
``extra_args["media_passthrough"]`` once screened (``output_format`` is one: png, webp or
jpeg), and ``extra_args`` is never read from the client.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from penstock.schemas.media_passthrough import nest_passthrough
from penstock.schemas.unicode import JSONValue, RequestModel

_GATEWAY_ONLY_ALIAS = "\x00extra_args"


class ImageNvExt(RequestModel):
    """Generation knobs beyond the OpenAI request."""

    model_config = ConfigDict(extra="forbid")

    annotations: list[str] | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)


class NvCreateImageRequest(RequestModel):
    """An image generation request (``size`` is ``WxH``)."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    extra_args: dict[str, Any] | None = Field(default=None, validation_alias=_GATEWAY_ONLY_ALIAS)
    prompt: str
    model: str | None = None
    n: int | None = Field(default=None, ge=1, le=10)
    quality: Literal["standard", "hd", "high", "medium", "low", "auto"] | None = None
    response_format: Literal["url", "b64_json"] | None = None
    size: str | None = None
    style: Literal["vivid", "natural"] | None = None
    user: str | None = None
    moderation: Literal["auto", "low"] | None = None
    input_reference: str | None = None
    nvext: ImageNvExt | None = None

    @property
    def unknown_fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def to_engine_request(self) -> dict[str, Any]:
        """The JSON object a raw engine receives; unknown fields nested and screened."""
        body = self.model_dump(exclude_none=True, exclude=set(self.unknown_fields))
        extra_args = nest_passthrough(self.extra_args, self.unknown_fields)
        if extra_args is not None:
            body["extra_args"] = extra_args
        return body


class ImageData(BaseModel):
    url: str | None = None
    b64_json: str | None = None
    revised_prompt: str | None = None


class NvImagesResponse(BaseModel):
    created: int
    data: list[ImageData] = Field(default_factory=list)
    background: str | None = None
    output_format: Literal["png", "webp", "jpeg"] | None = None
    size: str | None = None
    quality: str | None = None
    usage: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
