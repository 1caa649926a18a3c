"""Text in request bodies: stop strings have a length limit, and text must be valid Unicode."""

from __future__ import annotations

import json
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


def assert_400(response: httpx.Response, param: str | None, *words: str) -> None:
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


TEXT = "a\ud800b"
CHAT = {"model": MODEL, "messages": HELLO, "max_tokens": 4}


def with_message(message: dict[str, Any]) -> dict[str, Any]:
    return {**CHAT, "messages": [message]}


INVALID_UNICODE = [
    (
        "/v1/chat/completions",
        with_message({"role": "user", "content": TEXT}),
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        with_message({"role": "user", "content": [{"type": "text", "text": TEXT}]}),
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", {**CHAT, "model": TEXT}, "model"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stop": ["end", TEXT]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "user": TEXT}, "user"),
    (
        "/v1/chat/completions",
        {**CHAT, "chat_template_kwargs": {"x": [TEXT]}},
        "chat_template_kwargs",
    ),
    ("/v1/chat/completions", {**CHAT, "nvext": {TEXT: 1}}, "nvext"),
    ("/v1/completions", {"model": MODEL, "prompt": TEXT}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", TEXT]}, "prompt"),
    ("/v1/completions", {"model": TEXT, "prompt": "fine"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "fine", "vendor_knob": TEXT}, "vendor_knob"),
    ("/tokenize", {"model": MODEL, "prompt": TEXT}, "prompt"),
    (
        "/tokenize",
        {"model": MODEL, "messages": [{"role": "user", "content": TEXT}]},
        "messages[0].content",
    ),
    ("/tokenize", {"model": TEXT, "prompt": "fine"}, "model"),
    ("/detokenize", {"model": TEXT, "tokens": [1, 2]}, "model"),
    # Media bodies are read by the same JSON reader: the field is named there too.
    ("/v1/videos", {"model": MODEL, "prompt": TEXT}, "prompt"),
    ("/v1/images/generations", {"model": MODEL, "prompt": TEXT}, "prompt"),
]


def client_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_invalid_unicode_is_a_400_naming_the_field_and_the_connection_keeps_serving(
    server: ServerProcess,
) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        first = http.post("/v1/chat/completions", json=CHAT)
        assert first.status_code == 200, first.text
        port = client_port(first)

        for route, body, param in INVALID_UNICODE:
            # json.dumps writes the lone surrogate as the escape "\ud800".
            raw = json.dumps(body).encode()
            assert b"\\ud800" in raw
            response = http.post(route, content=raw, headers={"content-type": "application/json"})

            assert_400(response, param, "Unicode")
            assert response.headers.get("connection") != "close", route
            assert client_port(response) == port, route

        last = http.post("/v1/chat/completions", json=CHAT)
        assert last.status_code == 200, last.text
        assert client_port(last) == port
