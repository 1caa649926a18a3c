"""Video and image generation against a real ``penstock serve --engine diffusion``.

The official ``openai`` client drives the job API; every delivered MP4 is opened with
PyAV (codec, frame count, size, fps). Restarts use the same media store folder.
"""

from __future__ import annotations

import base64
import io
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import httpx
import openai
import pytest
from PIL import Image

from tests.support.server import ServerProcess, running_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL = "tiny-wan"
FAST = {"num_inference_steps": 2, "seed": 5}


def png_bytes(color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buffer, format="PNG")
    return buffer.getvalue()


def probe_mp4(data: bytes) -> tuple[str, int, int, int, float]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(video=0))
        rate = float(stream.average_rate)
        return stream.codec_context.name, frames, stream.width, stream.height, rate


def serve(store: Path, log_dir: Path) -> Any:
    return running_server(["--engine", "diffusion", "--media-store", str(store)], log_dir)


@dataclass
class MediaServer(ServerProcess):
    store: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MediaServer]:
    root = tmp_path_factory.mktemp("videos")
    with serve(root / "store", root) as process:
        yield MediaServer(process.process, process.port, process.log_path, root / "store")


@pytest.fixture(scope="module")
def client(server: MediaServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: MediaServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as session:
        yield session


def create(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    nvext = {"num_frames": 5, **FAST}
    body = {"model": MODEL, "prompt": "a paper boat", "size": "64x64", "nvext": nvext, **fields}
    response = http.post("/v1/videos", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(http: httpx.Client, video_id: str, *statuses: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = http.get(f"/v1/videos/{video_id}").json()
        if video["status"] in statuses:
            return video
        time.sleep(0.05)
    raise AssertionError(f"{video_id} never reached {statuses}: {video}")


def test_official_client_create_retrieve_list_download_delete(client: openai.OpenAI) -> None:
    video = client.videos.create(
        model=MODEL,
        prompt="a lighthouse at dusk",
        size="64x48",  # type: ignore[arg-type]
        seconds="1",  # type: ignore[arg-type]
        extra_body={"nvext": FAST},
    )
    assert video.object == "video" and video.status in ("queued", "in_progress")
    assert (video.size, video.seconds, video.model) == ("64x48", "1", MODEL)
    deadline = time.monotonic() + 60
    while video.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.05)
        video = client.videos.retrieve(video.id)
    assert video.status == "completed", video.error
    assert video.progress == 100 and video.completed_at is not None
    assert video.id in [v.id for v in client.videos.list(limit=100)]
    content = client.videos.download_content(video.id).content
    # 1 s at the engine's default 8 fps: 9 frames (Wan makes 1 + 4k frames).
    assert probe_mp4(content) == ("h264", 9, 64, 48, 8.0)
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_multipart_input_reference_upload(client: openai.OpenAI, http: httpx.Client) -> None:
    video = client.videos.create(
        model=MODEL,
        prompt="the same scene, but moving",
        size="64x64",  # type: ignore[arg-type]
        input_reference=("reference.png", png_bytes(), "image/png"),
        extra_body={"nvext": {**FAST, "num_frames": 5, "fps": 4}},
    )
    done = wait_for(http, video.id, "completed", "failed")
    assert done["status"] == "completed", done
    content = http.get(f"/v1/videos/{video.id}/content")
    assert content.headers["content-type"] == "video/mp4"
    assert probe_mp4(content.content) == ("h264", 5, 64, 64, 4.0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.videos.create(
            model=MODEL,
            prompt="x",
            input_reference=("reference.png", b"not an image at all", "image/png"),
        )
    assert caught.value.status_code == 415
    assert "input_reference" in caught.value.message


def test_content_supports_http_ranges(http: httpx.Client) -> None:
    video = wait_for(http, create(http)["id"], "completed")
    full = http.get(f"/v1/videos/{video['id']}/content")
    assert full.headers["accept-ranges"] == "bytes"
    size = len(full.content)
    head = http.get(f"/v1/videos/{video['id']}/content", headers={"Range": "bytes=0-99"})
    assert head.status_code == 206 and head.content == full.content[:100]
    assert head.headers["content-range"] == f"bytes 0-99/{size}"
    tail = http.get(f"/v1/videos/{video['id']}/content", headers={"Range": "bytes=-50"})
    assert tail.status_code == 206 and tail.content == full.content[-50:]
    beyond = http.get(f"/v1/videos/{video['id']}/content", headers={"Range": f"bytes={size}-"})
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{size}"


def test_delete_cancels_a_running_job_between_steps(http: httpx.Client) -> None:
    slow = create(http, nvext={"num_inference_steps": 1000, "seed": 1})
    running = wait_for(http, slow["id"], "in_progress")
    while running["progress"] == 0:
        running = http.get(f"/v1/videos/{slow['id']}").json()
    early = http.get(f"/v1/videos/{slow['id']}/content")
    assert early.status_code == 404
    assert "in_progress" in early.json()["error"]["message"]
    waiting = create(http)
    assert waiting["status"] == "queued" and waiting["queue_position"] == 1
    started = time.monotonic()
    deleted = http.delete(f"/v1/videos/{slow['id']}")
    assert deleted.json() == {"id": slow["id"], "object": "video.deleted", "deleted": True}
    assert http.get(f"/v1/videos/{slow['id']}").status_code == 404
    # The slow job had ~1000 steps left; the next one finishing now shows it stopped.
    wait_for(http, waiting["id"], "completed", timeout=20)
    assert time.monotonic() - started < 20


def test_jobs_beyond_the_pool_queue_with_positions_and_all_complete(http: httpx.Client) -> None:
    jobs = [
        create(http, nvext={"num_inference_steps": 3, "num_frames": 5, "seed": i}) for i in range(4)
    ]
    positions = [job.get("queue_position") for job in jobs if job["status"] == "queued"]
    assert len(positions) >= 3 and positions == sorted(positions)
    assert positions[-1] >= 3
    retrieved = http.get(f"/v1/videos/{jobs[-1]['id']}").json()
    assert retrieved["status"] != "queued" or retrieved["queue_position"] >= 1
    for job in jobs:
        assert wait_for(http, job["id"], "completed", "failed")["status"] == "completed"
    listed = http.get("/v1/videos", params={"limit": 4}).json()
    assert [v["id"] for v in listed["data"]] == [j["id"] for j in reversed(jobs)]
    page = http.get("/v1/videos", params={"limit": 2, "after": jobs[2]["id"]}).json()
    assert [v["id"] for v in page["data"]] == [jobs[1]["id"], jobs[0]["id"]]


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_streaming_form_reports_each_step_with_eta(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": "waves",
        "size": "32x32",
        "stream": True,
        "nvext": {"num_inference_steps": 4, "num_frames": 5, "fps": 10},
    }
    with http.stream("POST", "/v1/videos/generations", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    terminal = events[-2]
    steps = [e for e in events[:-2] if "step" in e]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all(e["total_steps"] == 4 and "eta_s" in e and 0 < e["progress"] < 100 for e in steps)
    assert terminal["status"] == "completed" and terminal["progress"] == 100
    item = terminal["data"][0]
    assert item["output_format"] == "mp4" and item["fps"] == 10
    assert probe_mp4(http.get(item["url"]).content) == ("h264", 5, 32, 32, 10.0)


def test_synchronous_form_returns_the_video_inline(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": "rain",
        "size": "48x32",
        "response_format": "b64_json",
        "nvext": {**FAST, "num_frames": 9, "fps": 12},
    }
    answer = http.post("/v1/videos/generations", json=body).json()
    assert answer["object"] == "video" and answer["status"] == "completed"
    assert answer["inference_time_s"] > 0
    mp4 = base64.b64decode(answer["data"][0]["b64_json"])
    assert probe_mp4(mp4) == ("h264", 9, 48, 32, 12.0)
    assert http.get(f"/v1/videos/{answer['id']}").json()["status"] == "completed"


def test_images_through_the_official_client(client: openai.OpenAI, http: httpx.Client) -> None:
    result = client.images.generate(
        model=MODEL,
        prompt="a red apple",
        n=2,
        size="32x32",  # type: ignore[arg-type]
        response_format="b64_json",
        extra_body={"nvext": FAST},
    )
    assert result.data is not None and len(result.data) == 2
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
    assert image.format == "PNG" and image.size == (32, 32)
    as_url = client.images.generate(
        model=MODEL, prompt="a pear", extra_body={"nvext": FAST, "output_format": "webp"}
    )
    assert as_url.data is not None
    fetched = http.get(as_url.data[0].url or "")
    assert fetched.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(fetched.content)).format == "WEBP"


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"prompt": None}, 400, "prompt", []),
        ({"size": "64"}, 400, "size", ["WIDTHxHEIGHT"]),
        ({"size": "63x64"}, 400, "size", ["multiples of 16"]),
        ({"size": "4096x64"}, 400, "size", ["1920x1920"]),
        ({"seconds": 0}, 400, "seconds", ["1 to 32"]),
        ({"seconds": 99}, 400, "seconds", ["1 to 32"]),
        ({"nvext": {"num_frames": 6}}, 400, "nvext.num_frames", ["1 + 4k", "257"]),
        ({"nvext": {"num_frames": 0}}, 400, "nvext.num_frames", []),
        ({"input_reference": "aGVsbG8gd29ybGQ="}, 415, "input_reference", []),
        ({"model_path": "/etc", "_debug": 1}, 400, "_debug", ["_debug, model_path"]),
        ({"model": "no-such-model"}, 404, "model", ["no-such-model"]),
        ({"stream": True}, 400, "stream", ["/v1/videos/generations"]),
    ],
)
def test_bad_input_is_rejected_clearly(
    http: httpx.Client, body: dict, status: int, param: str, words: list[str]
) -> None:
    request = {"model": MODEL, "prompt": "x", "size": "64x64", **body}
    request = {k: v for k, v in request.items() if v is not None}
    response = http.post("/v1/videos", json=request)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"]


def test_unknown_ids_are_404_and_the_server_keeps_serving(http: httpx.Client) -> None:
    for path in ("/v1/videos/video_nope", "/v1/videos/video_nope/content"):
        response = http.get(path)
        assert response.status_code == 404 and response.json()["error"]["param"] == "video_id"
    assert http.delete("/v1/videos/video_nope").status_code == 404
    assert wait_for(http, create(http)["id"], "completed")["progress"] == 100


def test_restart_keeps_jobs_and_fails_interrupted_ones(
    server: MediaServer, http: httpx.Client, tmp_path: Path
) -> None:
    """Kills this module's server mid-job (so it runs last) and restarts on its store."""
    done = wait_for(http, create(http)["id"], "completed")
    before = http.get(f"/v1/videos/{done['id']}/content").content
    running = create(http, nvext={"num_inference_steps": 1000, "seed": 2})
    wait_for(http, running["id"], "in_progress")
    waiting = create(http)
    assert waiting["status"] == "queued"
    server.stop(signal.SIGKILL)

    with serve(server.store, tmp_path) as second, httpx.Client(base_url=second.base_url) as again:
        listed = {v["id"]: v for v in again.get("/v1/videos", params={"limit": 100}).json()["data"]}
        assert listed[done["id"]]["status"] == "completed"
        assert again.get(f"/v1/videos/{done['id']}/content").content == before
        interrupted = listed[running["id"]]
        assert interrupted["status"] == "failed"
        assert "stopped while this job was running" in interrupted["error"]["message"]
        assert wait_for(again, waiting["id"], "completed", "failed")["status"] == "completed"
        assert second.stop() == 0
