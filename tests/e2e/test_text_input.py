"""Text in request bodies: stop strings have a length limit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from penstock.schemas.openai import MAX_STOP_LENGTH
from tests.support.openai_spec import spec_errors
from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("text-input")
    with running_server(["--engine", "sample", "--", "--delay", "0"], log_dir) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        yield http


def assert_400(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    assert spec_errors("ErrorResponse", response.json()) == []
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    for word in words:
        assert word in error["message"]


def generate(client: httpx.Client, route: str, **fields: Any) -> httpx.Response:
    body = {"messages": HELLO} if route == "/v1/chat/completions" else {"prompt": "hello"}
    return client.post(route, json={"model": MODEL, "max_tokens": 8, **body, **fields})


def output(response: httpx.Response) -> str:
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


ROUTES = ["/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize("route", ROUTES)
def test_stop_strings_up_to_the_limit_are_matched(client: httpx.Client, route: str) -> None:
    unstopped = generate(client, route)
    assert unstopped.status_code == 200, unstopped.text
    text = output(unstopped)

    stopped = generate(client, route, stop=["x" * MAX_STOP_LENGTH, text[2:5]])

    assert stopped.status_code == 200, stopped.text
    assert output(stopped) == text[:2]
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "stop", ["x" * (MAX_STOP_LENGTH + 1), ["end", "x" * (MAX_STOP_LENGTH + 1)]]
)
def test_a_stop_string_over_the_limit_is_refused(
    client: httpx.Client, route: str, stop: str | list[str]
) -> None:
    response = generate(client, route, stop=stop)

    assert_400(response, "stop", str(MAX_STOP_LENGTH), str(MAX_STOP_LENGTH + 1))
