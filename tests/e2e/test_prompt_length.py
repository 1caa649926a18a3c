"""Prompts too long to fit are refused by length; long prompts don't hold up other requests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
# The sample engine's context holds 2048 tokens; its longest token has 35 characters.
LIMIT = 2048 * 35


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("prompt-length")
    with running_server(["--engine", "sample", "--", "--delay", "0.001"], log_dir) as process:
        yield process


def assert_too_long(response: httpx.Response, param: str, chars: int) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == param
    # Judged by characters: the prompt was never tokenized.
    assert f"you sent {chars} characters" in error["message"]
    assert f"more than the {LIMIT} that can fit" in error["message"]


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "TEXT"}]}, "messages"),
        ("/v1/completions", {"prompt": "TEXT"}, "prompt"),
        ("/v1/completions", {"prompt": ["short", "TEXT"]}, "prompt"),
        ("/tokenize", {"prompt": "TEXT"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "TEXT"}]}, "messages"),
    ],
)
def test_a_prompt_beyond_the_bound_is_refused_by_its_length(
    client: httpx.Client, path: str, fields: dict[str, object], param: str
) -> None:
    text = "many words " * 400_000
    body = {"model": MODEL, **_replace(fields, "TEXT", text)}  # type: ignore[dict-item]
    assert_too_long(client.post(path, json=body), param, len(text))


def test_messages_count_together(client: httpx.Client) -> None:
    half = "x" * (LIMIT // 2 + 1)
    messages = [{"role": "user", "content": half}, {"role": "user", "content": half}]
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert_too_long(response, "messages", 2 * len(half))


def test_a_prompt_within_the_bound_is_still_judged_by_its_tokens(client: httpx.Client) -> None:
    # 3 characters a token: within the character bound, over the token budget.
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "ab " * 3000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "3001 in the prompt" in error["message"]


def test_other_requests_are_served_while_a_long_prompt_tokenizes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # A bound loose enough that megabytes get tokenized, as a long-context model allows.
    args = ["--engine", "sample", "--max-chars-per-token", "100000", "--", "--delay", "0"]
    with running_server(args, tmp_path_factory.mktemp("long-prompt")) as server:
        url = server.base_url
        finished: dict[str, float] = {}

        def long_prompt() -> None:
            body = {"model": MODEL, "prompt": "many words " * 140_000, "max_tokens": 1}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            finished["long"] = time.monotonic()
            assert response.status_code == 400  # over the token budget, once tokenized

        worker = threading.Thread(target=long_prompt)
        worker.start()
        time.sleep(0.3)
        assert httpx.get(f"{url}/live", timeout=120).status_code == 200
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        short = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        finished["short"] = time.monotonic()
        worker.join()
        assert short.status_code == 200
        assert finished["short"] < finished["long"]


def _replace(value: object, marker: str, text: str) -> object:
    if value == marker:
        return text
    if isinstance(value, dict):
        return {key: _replace(item, marker, text) for key, item in value.items()}
    if isinstance(value, list):
        return [_replace(item, marker, text) for item in value]
    return value
