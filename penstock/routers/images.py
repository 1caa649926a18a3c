"""Image generation: ``POST /v1/images/generations`` answers an ``NvImagesResponse``.

The request (JSON, or multipart with an ``input_reference`` image) runs through the
same media worker pool as video jobs. ``response_format`` ``b64_json`` returns the image
bytes inline; ``url`` (the default, as in OpenAI) stores each image in the media store
and returns a URL of ``GET /v1/images/{image_id}/content``. ``output_format`` (png, webp,
jpeg) travels to the engine as a passthrough field.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from penstock.engines.context import Context
from penstock.errors import EngineError, InvalidRequestError, NotFoundError, clip
from penstock.gateway import Gateway
from penstock.media.requests import (
    fill_default_model,
    read_media_body,
    reference_data_url,
    served_for,
    validate_body,
)
from penstock.multimodal.encoding import IMAGE_CONTENT_TYPES, data_url_bytes
from penstock.multimodal.limits import MediaParamError, VideoLimits, parse_size
from penstock.routers.deps import media_inputs, media_jobs, media_service
from penstock.routers.security import media_owner
from penstock.schemas.images import ImageData, NvCreateImageRequest, NvImagesResponse
from penstock.schemas.media_passthrough import ENDPOINT_TYPE_KEY, MediaPassthroughRejected
from penstock.serving.framing import unless_disconnected

router = APIRouter(tags=["images"])

ENDPOINT_TYPE = "images"
_IMAGE_ID_RE = re.compile(r"^img_[0-9a-f]{32}-\d{1,2}$")


async def _engine_request(
    request: Request, body: dict[str, Any]
) -> tuple[Any, dict[str, Any], str]:
    gateway: Gateway = request.app.state.gateway
    reference = body.pop("input_reference", None)
    fill_default_model(body, gateway, ENDPOINT_TYPE)
    image = validate_body(NvCreateImageRequest, body)
    if image.model is None:
        raise InvalidRequestError("model: Field required", param="model")
    served = served_for(gateway, image.model, ENDPOINT_TYPE, "/v1/images/generations")
    limits = VideoLimits.from_runtime_data(
        served.host.engine_config.runtime_data if served.host.engine_config else None
    )
    if image.size is not None:
        try:
            parse_size(
                image.size,
                param="size",
                multiple=limits.size_multiple,
                max_width=gateway.settings.media_max_width,
                max_height=gateway.settings.media_max_height,
            )
        except MediaParamError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from exc
    try:
        engine_request = image.to_engine_request()
    except MediaPassthroughRejected as exc:
        raise InvalidRequestError(str(exc), param=exc.keys[0], code="unsupported_field") from exc
    if reference not in (None, ""):
        engine_request["input_reference"] = await reference_data_url(
            reference, media_inputs(request)
        )
    engine_request.update(model=served.name, response_format="b64_json")
    engine_request.setdefault("extra_args", {})[ENDPOINT_TYPE_KEY] = ENDPOINT_TYPE
    return served, engine_request, image.response_format or "url"


@router.post("/v1/images/generations")
async def generate_images(request: Request) -> dict[str, Any]:
    body = await read_media_body(request, file_fields=frozenset({"input_reference"}))
    served, engine_request, response_format = await _engine_request(request, body)
    service = media_service(request)
    image_id = f"img_{uuid.uuid4().hex}"
    terminal = await unless_disconnected(
        request, service.generate_once(served, engine_request, Context(image_id))
    )
    output_format = str(terminal.get("output_format") or "png")
    if output_format not in IMAGE_CONTENT_TYPES:
        raise EngineError(f"the engine answered an unknown image format '{output_format}'")
    data: list[ImageData] = []
    owner = media_owner(request, service.jobs.owner_tag).tag
    for index, item in enumerate(terminal.get("data") or []):
        encoded = item.get("b64_json") or item.get("url") or ""
        payload = data_url_bytes(encoded) if isinstance(encoded, str) else None
        if payload is None:
            raise EngineError("the engine's answer holds no readable image")
        if response_format == "b64_json":
            data.append(ImageData(b64_json=encoded.rpartition(",")[2]))
            continue
        name = f"{image_id}-{index}"
        # Recorded first: a stored image without its row would be shared.
        await service.jobs.add_image(name, owner)
        await asyncio.to_thread(service.artifacts.put, f"images/{name}.{output_format}", payload)
        data.append(ImageData(url=str(request.url_for("download_image_content", image_id=name))))
    created = terminal.get("created")
    return NvImagesResponse(
        created=created if isinstance(created, int) else 0,
        data=data,
        output_format=output_format,  # type: ignore[arg-type]
        size=terminal.get("size"),
    ).wire()


@router.get("/v1/images/{image_id}/content", name="download_image_content")
async def download_image_content(image_id: str, request: Request) -> Response:
    missing = NotFoundError(
        f"No image found with id '{clip(image_id)}'", param="image_id", code="image_not_found"
    )
    if not _IMAGE_ID_RE.match(image_id):
        raise missing
    jobs = media_jobs(request)
    if not await jobs.image_visible(image_id, media_owner(request, jobs.owner_tag)):
        raise missing
    service = media_service(request)
    for extension, content_type in IMAGE_CONTENT_TYPES.items():
        key = f"images/{image_id}.{extension}"
        if await asyncio.to_thread(service.artifacts.size, key) is not None:
            payload = await asyncio.to_thread(service.artifacts.read, key)
            return Response(payload, media_type=content_type)
    raise missing
