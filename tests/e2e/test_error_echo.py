"""What a client sent comes back in an error message cut short, never whole, against a
real ``penstock serve --engine sample``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from penstock.errors import MAX_ECHO_CHARS
from tests.support.server import running_server

LONG = "x" * 20_000


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    log_dir: Path = tmp_path_factory.mktemp("echo")
    # Strict, so that an unknown field's long name is echoed in an error.
    with running_server(["--engine", "sample", "--no-allow-unknown-fields"], log_dir) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            yield client


def bounded(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert LONG not in error["message"] and "\u2026" in error["message"]
    assert len(error["message"]) < 2 * MAX_ECHO_CHARS
    assert error["param"] is None or len(error["param"]) <= MAX_ECHO_CHARS
    return error


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("POST", "/v1/completions", {"model": LONG, "prompt": "x"}, 404, "model"),
        ("POST", "/v1/completions", {"model": "sample-model", "prompt": "x", LONG: 1}, 400, None),
        ("POST", "/v1/completions", {"model": "sample-model", "prompt": "x", "n": LONG}, 400, "n"),
        ("GET", f"/v1/videos/{LONG}", None, 404, "video_id"),
        ("GET", "/v1/videos", None, 400, "after"),
        ("GET", f"/v1/images/{LONG}/content", None, 404, "image_id"),
    ],
)
def test_echoed_values_are_cut_short(
    http: httpx.Client,
    method: str,
    path: str,
    body: dict | None,
    status: int,
    param: str | None,
) -> None:
    params = {"after": LONG} if path == "/v1/videos" else None
    error = bounded(http.request(method, path, json=body, params=params), status)
    if param is not None:
        assert error["param"] == param
    assert http.get("/health").status_code == 200
