"""``/tokenize`` and ``/detokenize`` use the served model's tokenizer and template."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.server import ServerProcess, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(["--engine", "sample"], tmp_path_factory.mktemp("tok")) as process:
        yield process


def test_tokenize_matches_what_chat_sends_the_engine(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenized = httpx.post(
        f"{server.base_url}/tokenize",
        json={"model": "sample-model", "messages": messages, "return_token_strs": True},
    ).json()
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "sample-model", "messages": messages, "return_token_ids": True},
    ).json()
    assert tokenized["tokens"] == chat["prompt_token_ids"]
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == 2048
    assert "".join(tokenized["token_strs"]).startswith("<|im_start|>user")


def test_detokenize_round_trips(server: ServerProcess) -> None:
    text = "héllo wörld 日本"
    tokens = httpx.post(
        f"{server.base_url}/tokenize", json={"model": "sample-model", "prompt": text}
    ).json()["tokens"]
    back = httpx.post(
        f"{server.base_url}/detokenize", json={"model": "sample-model", "tokens": tokens}
    ).json()
    assert back == {"prompt": text}


def test_bad_tokenize_input(server: ServerProcess) -> None:
    both = httpx.post(
        f"{server.base_url}/tokenize",
        json={
            "model": "sample-model",
            "prompt": "x",
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    far = httpx.post(
        f"{server.base_url}/detokenize", json={"model": "sample-model", "tokens": [10**6]}
    )
    assert far.status_code == 400 and far.json()["error"]["param"] == "tokens"
    unknown = httpx.post(f"{server.base_url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404


def test_token_strs_are_the_vocabularys_pieces_and_only_when_asked(server: ServerProcess) -> None:
    url = f"{server.base_url}/tokenize"
    plain = httpx.post(url, json={"prompt": "a cat"}).json()
    asked = httpx.post(url, json={"prompt": "a cat", "return_token_strs": True}).json()
    assert plain["token_strs"] is None
    assert "Ġ" in "".join(asked["token_strs"]), asked["token_strs"]


def test_detokenize_needs_tokens(server: ServerProcess) -> None:
    response = httpx.post(f"{server.base_url}/detokenize", json={})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
