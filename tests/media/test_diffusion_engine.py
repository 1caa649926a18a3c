"""The ``diffusion`` engine on real (tiny, random-weight) diffusers pipelines."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import pytest
from PIL import Image

from penstock.engines.context import Context
from penstock.engines.diffusion import DiffusersEngine, pipeline
from penstock.engines.samples.diffusion import SampleDiffusionEngine
from penstock.multimodal.encoding import image_data_url
from tests.media.pipelines import save_tiny_stable_diffusion, save_tiny_wan

VIDEO = {
    "prompt": "a red kite over the sea",
    "size": "64x48",
    "response_format": "b64_json",
    "nvext": {"num_frames": 5, "num_inference_steps": 3, "seed": 11, "fps": 6},
}


def started(argv: list[str]) -> DiffusersEngine:
    async def build() -> DiffusersEngine:
        engine, _ = await DiffusersEngine.from_args(argv)
        await engine.start(1)
        return engine

    return asyncio.run(build())


@pytest.fixture(scope="module")
def engine() -> Iterator[DiffusersEngine]:
    built = started([])
    yield built
    asyncio.run(built.cleanup())


async def collect(engine: Any, request: dict[str, Any], context: Context | None = None) -> list:
    return [chunk async for chunk in engine.generate(request, context or Context())]


def probe_mp4(data: bytes) -> tuple[str, int, int, int, float]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(video=0))
        rate = float(stream.average_rate)
        return stream.codec_context.name, frames, stream.width, stream.height, rate


async def test_video_is_h264_at_the_asked_size_frames_and_fps(engine: DiffusersEngine) -> None:
    chunks = await collect(engine, dict(VIDEO))
    *progress, terminal = chunks
    assert [c["step"] for c in progress] == [1, 2, 3]
    assert all(c["status"] == "in_progress" and c["total_steps"] == 3 for c in progress)
    assert [c["progress"] for c in progress] == sorted(c["progress"] for c in progress)
    assert terminal["status"] == "completed" and terminal["progress"] == 100
    item = terminal["data"][0]
    assert item["output_format"] == "mp4" and item["fps"] == 6
    assert probe_mp4(base64.b64decode(item["b64_json"])) == ("h264", 5, 64, 48, 6.0)


async def test_same_seed_same_video_other_seed_other_video(engine: DiffusersEngine) -> None:
    def video(chunks: list) -> str:
        return chunks[-1]["data"][0]["b64_json"]

    first = video(await collect(engine, dict(VIDEO)))
    again = video(await collect(engine, dict(VIDEO)))
    other = video(await collect(engine, {**VIDEO, "nvext": {**VIDEO["nvext"], "seed": 12}}))
    assert first == again
    assert first != other


async def test_cancel_stops_between_steps(engine: DiffusersEngine) -> None:
    context = Context()
    request = {**VIDEO, "nvext": {**VIDEO["nvext"], "num_inference_steps": 200}}
    chunks = []
    async for chunk in engine.generate(request, context):
        chunks.append(chunk)
        if len(chunks) == 2:
            context.stop_generating()
    assert chunks[-1]["status"] == "failed" and chunks[-1]["error"] == "cancelled"
    assert len(chunks) < 10


async def test_seconds_times_fps_and_url_answer(engine: DiffusersEngine) -> None:
    nvext = {"fps": 8, "num_inference_steps": 1}
    request = {"prompt": "x", "size": "32x32", "seconds": 1, "nvext": nvext}
    terminal = (await collect(engine, request))[-1]
    url = terminal["data"][0]["url"]
    assert url.startswith("data:video/mp4;base64,")
    assert probe_mp4(base64.b64decode(url.partition(",")[2]))[1:] == (9, 32, 32, 8.0)


@pytest.mark.parametrize("image_format", ["png", "webp", "jpeg"])
async def test_images_in_each_format(engine: DiffusersEngine, image_format: str) -> None:
    request = {
        "prompt": "a lighthouse",
        "n": 2,
        "size": "48x32",
        "response_format": "b64_json",
        "nvext": {"num_inference_steps": 2, "seed": 3},
        "extra_args": {
            "endpoint_type": "images",
            "media_passthrough": {"output_format": image_format},
        },
    }
    (terminal,) = await collect(engine, request)
    assert terminal["output_format"] == image_format and terminal["size"] == "48x32"
    assert len(terminal["data"]) == 2
    for item in terminal["data"]:
        image = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
        assert image.format == image_format.upper() and image.size == (48, 32)


async def test_reference_image_guides_the_video(
    engine: DiffusersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Random weights wash a reference's colour out below 8-bit resolution, so the check is
    # on what the pipeline is given: every input frame is the reference, at the asked size.
    seen: list[list[Image.Image]] = []

    class RecordingPipeline(pipeline.WanVideoToVideoPipeline):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs["video"])
            return super().__call__(*args, **kwargs)

    monkeypatch.setattr(pipeline, "WanVideoToVideoPipeline", RecordingPipeline)
    red = image_data_url(Image.new("RGB", (80, 60), (255, 0, 0)))
    from_red = (await collect(engine, {**VIDEO, "input_reference": red}))[-1]
    assert probe_mp4(base64.b64decode(from_red["data"][0]["b64_json"])) == (
        "h264",
        5,
        64,
        48,
        6.0,
    )
    (frames,) = seen
    assert len(frames) == 5
    assert {frame.size for frame in frames} == {(64, 48)}
    assert {frame.getpixel((10, 10)) for frame in frames} == {(255, 0, 0)}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"nvext": {"num_frames": 6}}, ["num_frames", "1 + 4k"]),
        ({"size": "60x48"}, ["multiples of 16"]),
        ({"prompt": ""}, ["prompt"]),
        ({"output_format": "webm"}, ["mp4"]),
        ({"nvext": {"guidance_scale_2": 3.0}}, ["two-stage"]),
        ({"input_reference": "data:image/png;base64,aGVsbG8="}, ["input_reference"]),
        ({"extra_args": {"media_passthrough": {"vae_path": "/x"}}}, ["vae_path"]),
    ],
)
async def test_bad_requests_raise_clear_value_errors(
    engine: DiffusersEngine, change: dict, words: list[str]
) -> None:
    with pytest.raises(ValueError) as caught:
        await collect(engine, {**VIDEO, **change})
    for word in words:
        assert word in str(caught.value)


async def test_health_canary_runs_one_cheap_step(engine: DiffusersEngine) -> None:
    payload = await engine.health_check_payload()
    assert payload is not None and payload["_HEALTH_CHECK"] is True
    (terminal,) = await collect(engine, payload)
    assert len(terminal["data"]) == 1


def test_local_wan_folder_serves_videos(tmp_path: Path) -> None:
    folder = save_tiny_wan(tmp_path / "tiny-wan")

    async def run() -> tuple[str, list]:
        engine, config = await DiffusersEngine.from_args(["--model", str(folder)])
        await engine.start(1)
        try:
            return config.endpoint_types, await collect(engine, dict(VIDEO))
        finally:
            await engine.cleanup()

    endpoint_types, chunks = asyncio.run(run())
    assert endpoint_types == "videos,images"
    assert probe_mp4(base64.b64decode(chunks[-1]["data"][0]["b64_json"]))[:2] == ("h264", 5)


def test_local_text_to_image_folder_serves_images(tmp_path: Path) -> None:
    folder = save_tiny_stable_diffusion(tmp_path / "tiny-sd")

    async def run() -> tuple[str, dict, list]:
        engine, config = await DiffusersEngine.from_args(["--model", str(folder)])
        start = await engine.start(1)
        try:
            request = {
                "prompt": "a lighthouse",
                "n": 2,
                "size": "32x32",
                "nvext": {"num_inference_steps": 2},
                "extra_args": {"endpoint_type": "images"},
            }
            return config.endpoint_types, start.runtime_data or {}, await collect(engine, request)
        finally:
            await engine.cleanup()

    endpoint_types, runtime_data, (terminal,) = asyncio.run(run())
    assert endpoint_types == "images"
    assert runtime_data["media"]["max_num_frames"] == 1
    assert len(terminal["data"]) == 2
    image = Image.open(io.BytesIO(base64.b64decode(terminal["data"][0]["url"].partition(",")[2])))
    assert image.format == "PNG" and image.size == (32, 32)


def test_a_folder_without_a_pipeline_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        asyncio.run(DiffusersEngine.from_args(["--model", str(tmp_path)]))


async def test_sample_diffusion_answers_png_images() -> None:
    engine, config = await SampleDiffusionEngine.from_args(["--delay", "0"])
    assert config.endpoint_types == "images"
    (terminal,) = await collect(engine, {"prompt": "x", "n": 3, "response_format": "b64_json"})
    assert len(terminal["data"]) == 3
    image = Image.open(io.BytesIO(base64.b64decode(terminal["data"][0]["b64_json"])))
    assert image.format == "PNG" and image.size == (1, 1)
    (as_url,) = await collect(engine, {"prompt": "x"})
    assert as_url["data"][0]["url"].startswith("data:image/png;base64,")
    for bad, message in [("two", "must be an integer"), (11, "between 1 and 10")]:
        with pytest.raises(ValueError, match=message):
            await collect(engine, {"prompt": "x", "n": bad})
    payload = await engine.health_check_payload()
    canary = {"prompt": "ping", "n": 1, "response_format": "b64_json", "_HEALTH_CHECK": True}
    assert payload == canary
