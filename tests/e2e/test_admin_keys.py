"""Every admin route answers a key the same way: none is a 401, a key of neither set or
an inference key a 403, the admin key reaches the route. SGLang's profiling routes are
checked beside the admin router's own and SGLang's other admin routes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.server import ServerProcess, running_server

INFERENCE_KEY, ADMIN_KEY = "inference-key", "admin-key"
ADMIN_ROUTES = ("/engine/capabilities", "/flush_cache", "/start_profile", "/stop_profile")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--engine", "sample", "--api-key", INFERENCE_KEY, "--admin-api-key", ADMIN_KEY]
    with running_server(args, tmp_path_factory.mktemp("admin-keys")) as process:
        yield process


def call(server: ServerProcess, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    method = "GET" if path == "/engine/capabilities" else "POST"
    return httpx.request(method, f"{server.base_url}{path}", headers=headers, timeout=30)


@pytest.mark.parametrize("path", ADMIN_ROUTES)
def test_a_key_that_is_no_admin_key_is_forbidden(server: ServerProcess, path: str) -> None:
    for key in ("no-such-key", INFERENCE_KEY):
        answer = call(server, path, key)
        assert answer.status_code == 403, (key, answer.text)
        assert answer.json()["error"]["type"] == "permission_error"
    missing = call(server, path, None)
    assert missing.status_code == 401, missing.text
    assert "admin key" in missing.json()["error"]["message"]


def test_the_admin_key_reaches_the_profiling_routes(server: ServerProcess) -> None:
    stop = call(server, "/stop_profile", ADMIN_KEY)
    assert stop.status_code == 409, stop.text
    assert "no profile is running" in stop.json()["error"]["message"]
    start = call(server, "/start_profile", ADMIN_KEY)
    assert start.status_code == 400, start.text
