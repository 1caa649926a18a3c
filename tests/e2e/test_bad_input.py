"""Bad input gets a clear 4xx naming the field, and the server keeps serving everyone."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.openai_spec import spec_errors
from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("bad-input")
    with running_server(["--engine", "sample", "--", "--delay", "0"], log_dir) as process:
        yield process


def chat(client: httpx.Client, **fields: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **fields})


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text
    assert spec_errors("ErrorResponse", response.json()) == []
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["code"], str)
    if param is not None:
        assert error["param"] == param
    for word in words:
        assert word in error["message"]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"messages": []}, "messages", ["at least 1"]),
        ({"messages": "hello"}, "messages", []),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", ["robot"]),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", ["tool_call_id"]),
        ({"n": 0}, "n", []),
        ({"n": 17}, "n", ["between 1 and 16"]),
        ({"n": 2, "temperature": 0}, "n", ["greedy"]),
        ({"max_tokens": -1}, "max_tokens", []),
        ({"max_tokens": 4000}, "max_tokens", ["2048", "4000"]),
        ({"temperature": 2.5}, "temperature", []),
        ({"top_p": 1.5}, "top_p", []),
        ({"temperature": "hot"}, "temperature", []),
        ({"stop": [str(i) for i in range(17)]}, "stop", ["at most 16"]),
        ({"stream_options": {"include_usage": True}}, None, ["stream_options"]),
        ({"top_logprobs": 3}, None, ["logprobs"]),
        ({"priority": 1}, "priority", ["--scheduling-policy priority"]),
        ({"response_format": {"type": "json_object"}}, "response_format", ["can't honour"]),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
            ["image input"],
        ),
    ],
)
def test_chat_bad_input(client: httpx.Client, fields: dict, param: str | None, words: list) -> None:
    assert_error(chat(client, **fields), 400, param, *words)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": [1, 2, 99999]}, "prompt", ["99999", "vocabulary"]),
        ({"prompt": []}, "prompt", []),
        ({"prompt": [[1], []]}, "prompt", []),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", []),
        ({"prompt": "x", "suffix": "y"}, "suffix", ["not supported"]),
        ({"prompt": "x", "logprobs": 50}, "logprobs", []),
        ({"prompt": "x " * 3000}, "prompt", ["2048"]),
    ],
)
def test_completion_bad_input(client: httpx.Client, body: dict, param: str, words: list) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, **body})
    assert_error(response, 400, param, *words)


def test_invalid_json_and_unknown_model(client: httpx.Client) -> None:
    broken = client.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert_error(broken, 400, None, "JSON")
    assert_error(chat(client, model="no-such-model"), 404, "model", "no-such-model")
    assert chat(client, model="no-such-model").json()["error"]["code"] == "model_not_found"
    assert chat(client).status_code == 200


def test_body_over_the_limit_gets_413(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--max-body-mb", "0.001", "--", "--delay", "0"]
    with running_server(args, tmp_path) as server:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=big)
        assert_error(response, 413, None, "limit")

        def chunks() -> Iterator[bytes]:
            yield b'{"model": "sample-model", "messages": [{"role": "user", "content": "'
            yield b"x" * 5000
            yield b'"}]}'

        chunked = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert_error(chunked, 413, None, "limit")
        small = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
        assert httpx.post(f"{server.base_url}/v1/chat/completions", json=small).status_code == 200


def test_api_keys_guard_v1_but_not_the_exempt_paths(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--api-key", "k1", "--api-key", "k2", "--", "--delay", "0"]
    with running_server(args, tmp_path) as server:
        url = f"{server.base_url}/v1/models"
        assert_error(httpx.get(url), 401, None, "Missing API key")
        assert_error(httpx.get(url, headers={"Authorization": "Bearer nope"}), 401, None, "Invalid")
        assert httpx.get(url, headers={"Authorization": "Bearer k2"}).status_code == 200
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
        assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body).status_code == 401
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert httpx.get(f"{server.base_url}/live").status_code == 200


def test_idle_streams_get_keepalive_comments(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--sse-keepalive-s", "0.1", "--", "--delay", "0.35"]
    with running_server(args, tmp_path) as server:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line]
        assert ": keep-alive" in lines
        assert lines[-1] == "data: [DONE]"
    args_off = ["--engine", "sample", "--sse-keepalive-s", "0", "--", "--delay", "0.3"]
    with running_server(args_off, tmp_path) as server:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            assert not [line for line in response.iter_lines() if line.startswith(":")]


def test_client_disconnect_aborts_the_engine_request(tmp_path: Path) -> None:
    marker = tmp_path / "engine.txt"
    engine = "tests.support.doubles:AbortRecordingEngine"
    args = ["--engine", engine, "--", "--marker", str(marker), "--delay", "0.02"]
    with running_server(args, tmp_path) as server:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1500, "stream": True}
        headers = {"X-Request-Id": "leaving-early"}
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json=body, headers=headers
        ) as response:
            lines = response.iter_lines()
            next(lines)
            next(lines)
        deadline = time.monotonic() + 5
        while "abort" not in marker.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        log = marker.read_text().splitlines()
        assert log.count("abort leaving-early") == 1
        time.sleep(0.3)
        after = marker.read_text().splitlines()
        tokens_after_abort = after[after.index("abort leaving-early") :]
        assert len([line for line in tokens_after_abort if line.startswith("token")]) <= 1
        assert int(log[-2].split()[1]) < 100


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5000)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = [
    "messages",
    "prompt",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "seed",
    "stop_token_ids",
    "min_tokens",
    "response_format",
    "return_token_ids",
    "echo",
    "user",
    "unknown_field",
]
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
            "content": st.text(max_size=20),
        }
    ),
    max_size=3,
)


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(st.sampled_from([MODEL, MODEL, "other", 3]))}
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        if field == "messages":
            body[field] = draw(MESSAGES | JSON_VALUES)
        elif field == "max_tokens":
            body[field] = draw(st.integers(-2, 64) | JSON_VALUES)
        elif field == "n":
            body[field] = draw(st.integers(-1, 4) | JSON_VALUES)
        else:
            body[field] = draw(JSON_VALUES)
    return body


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies(), route=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_generated_bodies_never_500_and_never_hang(
    client: httpx.Client, body: dict, route: str
) -> None:
    response = client.post(
        route, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=20
    )
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert spec_errors("ErrorResponse", response.json()) == []
