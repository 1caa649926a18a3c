"""Video generation: the OpenAI job API and the synchronous / streaming form.

OpenAI (and SGLang) run video as a job the client polls; Dynamo answers synchronously at
another path. Penstock serves both, from one engine and one job store:

* ``POST /v1/videos`` (JSON or multipart with an ``input_reference`` image) validates the
  request, stores a job and returns the OpenAI ``video`` object at once (``queued``, with
  ``queue_position``). The job runs in the media worker pool.
* ``GET /v1/videos/{id}``, ``GET /v1/videos`` (newest first; ``after``, ``limit``,
  ``order``), ``GET /v1/videos/{id}/content`` (the MP4; HTTP ``Range`` supported) and
  ``DELETE /v1/videos/{id}`` (stops a running job between denoising steps, then deletes
  the record and the file).
* ``POST /v1/videos/generations`` takes the same request and answers the
  ``NvVideosResponse`` when the video is done (``data[0].url`` points at the content
  route, or ``b64_json`` holds the MP4). With ``"stream": true`` it answers server-sent
  events instead: ``queued`` (with ``queue_position``), one ``in_progress`` event per
  denoising step (``progress``, ``step``, ``total_steps``, ``eta_s``), then the terminal
  ``NvVideosResponse`` and ``[DONE]``. Its jobs are stored like the others (listed,
  downloadable); a client that goes away cancels its job.

``stream`` on ``POST /v1/videos`` is refused: a job is polled, a stream is asked for at
``/v1/videos/generations``.
"""

from __future__ import annotations

import asyncio
import base64
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse
from starlette.responses import Response, StreamingResponse

from penstock.errors import (
    EngineError,
    InvalidRequestError,
    NotFoundError,
    PenstockError,
    clip,
)
from penstock.gateway import Gateway
from penstock.media.records import (
    COMPLETED,
    FAILED,
    JobRecords,
    Owner,
    PageQuery,
    VideoJob,
)
from penstock.media.requests import (
    fill_default_model,
    read_media_body,
    reference_data_url,
    served_for,
    validate_body,
)
from penstock.media.service import JobEvent, MediaService
from penstock.multimodal.encoding import VIDEO_CONTENT_TYPES
from penstock.multimodal.limits import MediaParamError, VideoLimits, plan_video
from penstock.routers.deps import media_inputs, media_jobs, media_service
from penstock.routers.security import media_owner
from penstock.schemas.media_passthrough import ENDPOINT_TYPE_KEY, MediaPassthroughRejected
from penstock.schemas.video import NvCreateVideoRequest, NvVideosResponse, VideoData
from penstock.serving.framing import unless_disconnected
from penstock.serving.sse import DONE_FRAME, EventStreamResponse, data_frame

router = APIRouter(tags=["videos"])

ENDPOINT_TYPE = "videos"
MAX_PAGE = 100
CONTENT_CHUNK = 1 << 20
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _owner(request: Request, jobs: JobRecords) -> Owner:
    return media_owner(request, jobs.owner_tag)


async def _job_or_404(request: Request, video_id: str) -> VideoJob:
    """The job if the caller may see it; another key's job is as missing as no job."""
    jobs = media_jobs(request)
    job = await jobs.get(video_id, _owner(request, jobs))
    if job is None:
        raise NotFoundError(
            f"No video found with id '{clip(video_id)}'", param="video_id", code="video_not_found"
        )
    return job


async def _new_job(request: Request) -> tuple[VideoJob, bool, str]:
    """Validate a create request; returns the job (not stored yet), stream, response_format."""
    gateway: Gateway = request.app.state.gateway
    body = await read_media_body(request, file_fields=frozenset({"input_reference"}))
    reference = body.pop("input_reference", None)
    fill_default_model(body, gateway, ENDPOINT_TYPE)
    video = validate_body(NvCreateVideoRequest, body)
    served = served_for(gateway, video.model, ENDPOINT_TYPE, "/v1/videos")
    limits = VideoLimits.from_runtime_data(
        served.host.engine_config.runtime_data if served.host.engine_config else None
    )
    nvext = video.nvext
    try:
        plan = plan_video(
            size=video.size,
            seconds=video.seconds,
            fps=nvext.fps if nvext else None,
            num_frames=nvext.num_frames if nvext else None,
            num_inference_steps=nvext.num_inference_steps if nvext else None,
            limits=limits,
            max_width=gateway.settings.media_max_width,
            max_height=gateway.settings.media_max_height,
        )
    except MediaParamError as exc:
        raise InvalidRequestError(exc.message, param=exc.param) from exc
    if video.output_format not in (None, *VIDEO_CONTENT_TYPES):
        raise InvalidRequestError(
            f"output_format: '{clip(video.output_format)}' is not supported: use "
            + ", ".join(VIDEO_CONTENT_TYPES),
            param="output_format",
        )
    try:
        engine_request = video.to_engine_request()
    except MediaPassthroughRejected as exc:
        raise InvalidRequestError(str(exc), param=exc.keys[0], code="unsupported_field") from exc
    if reference not in (None, ""):
        if not limits.accepts_input_reference:
            raise InvalidRequestError(
                f"input_reference: the model '{served.name}' does not take a reference image",
                param="input_reference",
            )
        engine_request["input_reference"] = await reference_data_url(
            reference, media_inputs(request)
        )
    engine_request.pop("stream", None)
    engine_request.update(
        model=served.name,
        size=plan.size,
        response_format="b64_json",
        output_format="mp4",
    )
    engine_request["nvext"] = {
        **engine_request.get("nvext", {}),
        "fps": plan.fps,
        "num_frames": plan.num_frames,
        "num_inference_steps": plan.num_inference_steps,
    }
    engine_request.setdefault("extra_args", {})[ENDPOINT_TYPE_KEY] = ENDPOINT_TYPE
    job = VideoJob(
        id=f"video_{uuid.uuid4().hex}",
        model=served.name,
        prompt=video.prompt,
        seconds=plan.seconds,
        size=plan.size,
        request=engine_request,
        owner=_owner(request, media_jobs(request)).tag,
    )
    return job, bool(video.stream), video.response_format or "url"


@router.post("/v1/videos")
async def create_video(request: Request) -> dict[str, Any]:
    job, stream, _ = await _new_job(request)
    if stream:
        raise InvalidRequestError(
            "stream: POST /v1/videos creates a job to poll; for progress events use "
            "POST /v1/videos/generations with stream: true",
            param="stream",
        )
    service = media_service(request)
    await service.submit_video(job)
    return await service.video_object(job)


@router.get("/v1/videos")
async def list_videos(
    request: Request,
    after: str | None = None,
    limit: int = Query(default=20, ge=1, le=MAX_PAGE),
    order: str = Query(default="desc", pattern="^(asc|desc)$"),
) -> dict[str, Any]:
    records = media_jobs(request)
    try:
        jobs, has_more = await records.page(
            PageQuery(limit, after, order == "desc", _owner(request, records))
        )
    except KeyError as exc:
        raise InvalidRequestError(
            f"after: no video with id '{clip(after)}'", param="after", code="invalid_cursor"
        ) from exc
    data = [await media_service(request).video_object(job) for job in jobs]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, request: Request) -> dict[str, Any]:
    job = await _job_or_404(request, video_id)
    return await media_service(request).video_object(job)


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, request: Request) -> dict[str, Any]:
    await _job_or_404(request, video_id)
    await media_service(request).delete_video(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, end)`` asked by a single-range ``Range`` header; None for the whole file.

    Raises :class:`ValueError` for a range that can't be satisfied.
    """
    if not header:
        return None
    match = _RANGE_RE.match(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if first == "" and last == "":
        return None
    if first == "":
        length = int(last)
        if length == 0:
            raise ValueError(header)
        return max(size - length, 0), size
    start = int(first)
    end = min(int(last) + 1, size) if last else size
    if start >= size or end <= start:
        raise ValueError(header)
    return start, end


@router.get("/v1/videos/{video_id}/content", name="download_video_content")
async def download_video_content(
    video_id: str, request: Request, variant: str = "video"
) -> Response:
    job = await _job_or_404(request, video_id)
    service = media_service(request)
    if variant != "video":
        raise InvalidRequestError(
            f"variant: '{clip(variant)}' is not available; supported: video", param="variant"
        )
    if job.status != COMPLETED or not job.artifact:
        reason = f" ({job.error_message})" if job.status == FAILED and job.error_message else ""
        raise NotFoundError(
            f"Video '{video_id}' is not ready: its status is {job.status}{reason}. "
            f"Use GET /v1/videos/{video_id} to check its status.",
            param="video_id",
            code="video_not_ready",
        )
    if job.artifact.startswith(("http://", "https://")):
        return RedirectResponse(job.artifact, status_code=307)
    key = job.artifact
    size = await asyncio.to_thread(service.artifacts.size, key)
    if size is None:
        raise NotFoundError(
            f"The file of video '{video_id}' is missing from the media store",
            param="video_id",
            code="video_content_missing",
        )
    content_type = job.content_type or "application/octet-stream"
    headers = {"accept-ranges": "bytes"}
    try:
        wanted = _byte_range(request.headers.get("range"), size)
    except ValueError:
        return Response(status_code=416, headers={**headers, "content-range": f"bytes */{size}"})
    status = 200
    start, end = 0, size
    if wanted is not None:
        start, end = wanted
        status = 206
        headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
    headers["content-length"] = str(end - start)
    headers["content-disposition"] = f'inline; filename="{video_id}.{key.rsplit(".", 1)[-1]}"'

    async def chunks() -> AsyncIterator[bytes]:
        position = start
        while position < end:
            upto = min(position + CONTENT_CHUNK, end)
            yield await asyncio.to_thread(service.artifacts.read, key, position, upto)
            position = upto

    return StreamingResponse(chunks(), status_code=status, media_type=content_type, headers=headers)


# -- synchronous and streaming form -----------------------------------------------------


async def _final_response(
    request: Request, service: MediaService, job: VideoJob, response_format: str
) -> dict[str, Any]:
    response = NvVideosResponse(
        id=job.id,
        model=job.model,
        status=job.status,
        progress=job.progress,
        created=job.created_at,
        error=job.error_message if job.status == FAILED else None,
        inference_time_s=job.inference_time_s,
    )
    if job.status == COMPLETED and job.artifact:
        output_format = job.artifact.rsplit(".", 1)[-1]
        fps = (job.request.get("nvext") or {}).get("fps")
        if job.artifact.startswith(("http://", "https://")):
            item: dict[str, Any] = {"url": job.artifact}
        elif response_format == "b64_json":
            payload = await asyncio.to_thread(service.artifacts.read, job.artifact)
            item = {"b64_json": base64.b64encode(payload).decode()}
        else:
            item = {"url": str(request.url_for("download_video_content", video_id=job.id))}
        response.data.append(VideoData(output_format=output_format, fps=fps, **item))
    return response.wire()


def _event_frame(event: JobEvent) -> bytes:
    job = event.job
    body: dict[str, Any] = {
        "id": job.id,
        "object": "video",
        "model": job.model,
        "status": job.status,
        "progress": job.progress,
        "created": job.created_at,
    }
    for name in ("queue_position", "step", "total_steps", "eta_s"):
        value = getattr(event, name)
        if value is not None:
            body[name] = value
    return data_frame(orjson.dumps(body))


async def _next_final(queue: asyncio.Queue[JobEvent]) -> JobEvent:
    while True:
        event = await queue.get()
        if event.final:
            return event


@router.post("/v1/videos/generations")
async def generate_video(request: Request) -> Any:
    job, stream, response_format = await _new_job(request)
    service = media_service(request)
    gateway: Gateway = request.app.state.gateway
    events = service.subscribe(job.id)
    try:
        await service.submit_video(job)
    except PenstockError:
        service.unsubscribe(job.id, events)
        raise

    def cancel_if_unfinished() -> None:
        service.unsubscribe(job.id, events)
        if service.holds(job.id):
            gateway.host.spawn(service.cancel_video(job.id))

    if not stream:
        try:
            final = await unless_disconnected(request, _next_final(events))
        finally:
            cancel_if_unfinished()
        return _sync_answer(
            final, await _final_response(request, service, final.job, response_format)
        )

    async def frames() -> AsyncIterator[bytes]:
        try:
            position = service.pool.position(job.id)
            if position is not None:
                yield _event_frame(JobEvent(job, queue_position=position))
            while True:
                event = await events.get()
                if event.final:
                    final = await _final_response(request, service, event.job, response_format)
                    yield data_frame(orjson.dumps(final))
                    yield DONE_FRAME
                    return
                yield _event_frame(event)
        finally:
            cancel_if_unfinished()

    return EventStreamResponse(frames(), keepalive_s=gateway.settings.sse_keepalive_s)


def _sync_answer(final: JobEvent, body: dict[str, Any]) -> dict[str, Any]:
    """The folded answer; a failed job is an error status (the engine's own if it had one)."""
    if final.job.status == COMPLETED:
        return body
    if isinstance(final.error, PenstockError):
        raise final.error
    raise EngineError(final.job.error_message or "video generation failed")
