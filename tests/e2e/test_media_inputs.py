"""Media references in requests are fetched and decoded by the gateway, under its policy.

Real ``penstock serve`` processes; images and audio come as data URLs or from a loopback
HTTP server that only an explicit ``--allowed-media-network`` lets the gateway reach. The
sample engines report what they were handed (``[image WxH]``, the reference image).
"""

from __future__ import annotations

import base64
import io
import time
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.support.file_server import serving, static_files
from tests.support.media_files import declared_png
from tests.support.server import running_server

MODEL = "sample-model"
ALLOW_LOOPBACK = ["--media-allow-http", "--allowed-media-network", "127.0.0.0/8"]


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 160, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def wav(seconds: float, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\x00\x10" * int(seconds * rate))
    return buffer.getvalue()


FILES = {"/photo.png": png(40, 30), "/huge.png": png(200, 100)}


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    with serving(static_files(FILES)) as url:
        yield url


def _serve(args: list[str], tmp: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    root = tmp.mktemp("media-inputs")
    with (
        running_server(["--media-store", str(root / "store"), *args], root) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def allowed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    limits = ["--media-max-images-per-request", "2", "--media-max-image-pixels", "10000"]
    engine = ["--", "--delay", "0", "--image-input", "--audio-input"]
    yield from _serve(["--engine", "sample", *ALLOW_LOOPBACK, *limits, *engine], tmp_path_factory)


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    yield from _serve(
        ["--engine", "sample", "--", "--delay", "0", "--image-input"], tmp_path_factory
    )


def chat(client: httpx.Client, *parts: dict[str, Any]) -> httpx.Response:
    content = [{"type": "text", "text": "what is this?"}, *parts]
    body = {"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": content}]}
    return client.post("/v1/chat/completions", json=body)


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def assert_error(response: httpx.Response, status: int, param: str, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error


def test_data_url_and_loopback_url_images_are_decoded(allowed: httpx.Client, files: str) -> None:
    response = chat(allowed, image(data_url(png(3, 2))), image(f"{files}/photo.png"))
    assert response.status_code == 200, response.text
    reply = response.json()["choices"][0]["message"]["content"]
    assert reply.startswith("[image 3x2] [image 40x30]"), reply


def test_input_audio_is_decoded(allowed: httpx.Client) -> None:
    part = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    part["input_audio"]["data"] = base64.b64encode(wav(0.5, 8000)).decode()
    response = chat(allowed, part)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].startswith("[audio 0.50s 8000Hz]")


def test_limits_are_named(allowed: httpx.Client, files: str) -> None:
    small = image(data_url(png(2, 2)))
    too_many = chat(allowed, small, small, small)
    assert_error(
        too_many, 400, "messages[0].content[3].image_url.url", "--media-max-images-per-request"
    )
    too_big = chat(allowed, small, image(f"{files}/huge.png"))
    assert_error(
        too_big, 413, "messages[0].content[2].image_url.url", "200x100", "--media-max-image-pixels"
    )
    missing = chat(allowed, image(f"{files}/missing.png"))
    assert_error(missing, 404, "messages[0].content[1].image_url.url")


def test_url_outside_the_policy_and_unsupported_media_are_refused(
    strict: httpx.Client, files: str
) -> None:
    blocked = chat(strict, image(f"{files}/photo.png"))
    assert_error(blocked, 400, "messages[0].content[1].image_url.url", "media URL policy")
    part = {"type": "audio_url", "audio_url": {"url": data_url(wav(0.1, 8000), "audio/wav")}}
    no_audio = chat(strict, part)
    assert_error(no_audio, 400, "messages[0].content[1].audio_url.url", "audio input")
    assert chat(strict, image(data_url(png(5, 5)))).status_code == 200


def _diffusion(args: list[str], tmp: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    engine = ["--", "--delay", "0", "--endpoint-types", "images,videos", "--input-reference"]
    yield from _serve(["--engine", "sample-diffusion", *args, *engine], tmp)


@pytest.fixture(scope="module")
def video_allowed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    yield from _diffusion(ALLOW_LOOPBACK, tmp_path_factory)


@pytest.fixture(scope="module")
def video_strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    yield from _diffusion([], tmp_path_factory)


def create_video(client: httpx.Client, reference: str) -> httpx.Response:
    body = {"prompt": "the same, moving", "size": "64x64", "input_reference": reference}
    return client.post("/v1/videos", json=body)


def test_video_input_reference_url_is_fetched_when_allowed(
    video_allowed: httpx.Client, files: str
) -> None:
    created = create_video(video_allowed, f"{files}/photo.png")
    assert created.status_code == 200, created.text
    video_id = created.json()["id"]
    deadline = time.monotonic() + 30
    while (job := video_allowed.get(f"/v1/videos/{video_id}").json())["status"] != "completed":
        assert job["status"] in ("queued", "in_progress") and time.monotonic() < deadline, job
        time.sleep(0.05)
    content = video_allowed.get(f"/v1/videos/{video_id}/content").content
    # The sample engine answers with the reference it was handed.
    assert Image.open(io.BytesIO(content)).size == (40, 30)


def test_video_input_reference_url_outside_the_policy_is_refused(
    video_strict: httpx.Client, files: str
) -> None:
    refused = create_video(video_strict, f"{files}/photo.png")
    assert_error(refused, 400, "input_reference", "media URL policy")


@pytest.mark.parametrize(
    "host",
    ["[::127.0.0.1]", "[::ffff:0:127.0.0.1]", "[64:ff9b:1::127.0.0.1]"],
    ids=["ipv4-compatible", "ipv4-translated", "nat64-local-use"],
)
def test_ipv6_spellings_of_ipv4_are_blocked_before_connecting(
    allowed: httpx.Client, host: str
) -> None:
    # 127.0.0.0/8 is open on this server; these IPv6 forms carry an IPv4 address but are
    # not in that range, so they are refused as blocked, not tried.
    refused = chat(allowed, image(f"http://{host}:9/photo.png"))
    assert_error(refused, 400, "messages[0].content[1].image_url.url", "blocked address")


def test_every_form_of_input_reference_is_held_to_the_pixel_limit(
    video_strict: httpx.Client,
) -> None:
    large = declared_png(5000, 5000)
    inline = base64.b64encode(large).decode()
    answers = [
        create_video(video_strict, data_url(large)),
        create_video(video_strict, inline),
        video_strict.post(
            "/v1/videos",
            data={"prompt": "the same, moving", "size": "64x64"},
            files={"input_reference": ("large.png", large, "image/png")},
        ),
        video_strict.post(
            "/v1/images/generations",
            json={"prompt": "the same", "size": "64x64", "input_reference": data_url(large)},
        ),
    ]
    for answer in answers:
        assert_error(answer, 413, "input_reference", "5000x5000", "--media-max-image-pixels")
    not_an_image = create_video(video_strict, base64.b64encode(b"GIF89a, or not").decode())
    assert_error(not_an_image, 415, "input_reference", "JPEG, PNG or WEBP")
