"""Image parts and output constraints reach engines that advertise them."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
from PIL import Image

from tests.support.server import running_server


def png_data_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_image_parts_and_response_format_reach_the_engine(tmp_path: Path) -> None:
    with running_server(["--engine", "tests.support.doubles:CapableEngine"], tmp_path) as server:
        content = [
            {"type": "text", "text": "What is in these?"},
            {"type": "image_url", "image_url": {"url": png_data_url(3, 2)}},
            {"type": "image_url", "image_url": {"url": png_data_url(1, 4)}},
        ]
        schema = {"name": "answer", "schema": {"type": "object"}}
        body = {
            "model": "sample-model",
            "messages": [{"role": "user", "content": content}],
            "response_format": {"type": "json_schema", "json_schema": schema},
        }
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        seen = json.loads(response.json()["choices"][0]["message"]["content"])
        assert seen["image_sizes"] == [[3, 2], [1, 4]]
        assert seen["guided_decoding"] == {"json": {"type": "object"}}
