"""A tiny vision-language (LLaVA) checkpoint on a real ``penstock serve --engine
transformers``: chat images as data URLs and from an allowed loopback server reach the
model, steer its output, are encoded once per distinct image, and share the batch with
text-only requests."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.support.file_server import serving, static_files
from tests.support.server import ServerProcess, running_server
from tests.support.tiny_vlm import build_tiny_vlm

MODEL = "tiny-vlm"
ALLOW_LOOPBACK = ["--media-allow-http", "--allowed-media-network", "127.0.0.0/8"]


def png(color: tuple[int, int, int]) -> bytes:
    image = Image.new("RGB", (48, 40), color)
    image.paste((255 - color[0], 255 - color[1], color[2]), (0, 0, 24, 20))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


FILES = {"/photo.png": png((30, 140, 220))}


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    with serving(static_files(FILES)) as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir: Path = build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))
    args = ["--engine", "transformers", "--model", str(model_dir), *ALLOW_LOOPBACK]
    with running_server(
        [*args, "--", "--served-model-name", MODEL, "--cpu-threads", "1"],
        tmp_path_factory.mktemp("serve"),
        env={"HF_HUB_OFFLINE": "1"},
        ready_timeout=120,
    ) as process:
        yield process


def chat_content(*images: str) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "what is in"}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    content.append({"type": "text", "text": "this picture?"})
    return content


def chat(server: ServerProcess, *images: str, max_tokens: int = 8) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": chat_content(*images)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def completion_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"]


def counter(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert len(found) == 1, text
    return float(found[0])


def test_images_by_data_url_and_loopback_url_answer_and_steer_the_output(
    server: ServerProcess, files: str
) -> None:
    # The engine refuses a prompt without one placeholder per image: a 200 means the
    # chat template placed the image part.
    red = chat(server, data_url(png((220, 20, 20))))
    assert len(completion_ids(red)) == 8
    text_only = chat(server)
    fetched = chat(server, f"{files}/photo.png")
    inline = chat(server, data_url(FILES["/photo.png"]))
    assert completion_ids(fetched) == completion_ids(inline)
    outputs = {tuple(completion_ids(r)) for r in (red, fetched, text_only)}
    assert len(outputs) == 3, "each image, and no image, gives its own greedy output"


def test_the_same_image_twice_runs_the_vision_tower_once(server: ServerProcess) -> None:
    calls = counter(server, "penstock_engine_vision_encoder_calls_total")
    hits = counter(server, "penstock_engine_vision_encoder_cache_hits_total")
    image = data_url(png((10, 200, 90)))
    first, second = chat(server, image), chat(server, image)
    assert completion_ids(first) == completion_ids(second)
    assert counter(server, "penstock_engine_vision_encoder_calls_total") == calls + 1
    assert counter(server, "penstock_engine_vision_encoder_cache_hits_total") == hits + 1


def test_text_and_image_requests_run_concurrently(server: ServerProcess) -> None:
    image = data_url(png((120, 60, 200)))
    with ThreadPoolExecutor(4) as pool:
        replies = list(
            pool.map(lambda urls: chat(server, *urls, max_tokens=16), [(image,), (), (image,), ()])
        )
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    ids = [completion_ids(r) for r in replies]
    assert ids[0] == ids[2] and ids[1] == ids[3] and ids[0] != ids[1]


def test_usage_counts_the_image_feature_tokens(server: ServerProcess) -> None:
    image = data_url(png((5, 5, 5)))
    answer = chat(server, image, max_tokens=1).json()
    messages = [{"role": "user", "content": chat_content(image)}]
    rendered = httpx.post(
        f"{server.base_url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60
    )
    assert rendered.status_code == 200, rendered.text
    # The tiny checkpoint turns the one placeholder token into 16 image feature tokens.
    assert answer["usage"]["prompt_tokens"] == rendered.json()["count"] - 1 + 16
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + 1
