"""The prefix cache of ``penstock serve --engine transformers`` kept apart by API key: with
two inference keys, one key's cached prompt neither saves another key work nor shows in
its ``cached_tokens``; ``--no-cache-salt-by-key`` shares it again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess, transformers_server
from tests.support.tiny_llm import build_tiny_llama

KEYS = ("key-a", "key-b")
# Several full blocks of 16 tokens.
PROMPT = [(7 * i) % 1_500 + 40 for i in range(100)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def cached_tokens(server: ServerProcess, key: str, salt: str | None = None) -> int:
    body: dict[str, object] = {"prompt": PROMPT, "max_tokens": 1}
    body["model"] = httpx.get(
        f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
    ).json()["data"][0]["id"]
    if salt is not None:
        body["cache_salt"] = salt
    reply = httpx.post(
        f"{server.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    with transformers_server(model_dir, tmp_path_factory.mktemp("serve"), *keys) as process:
        yield process


def test_one_keys_cached_prompt_is_not_another_keys(server: ServerProcess) -> None:
    assert cached_tokens(server, "key-a") == 0
    assert cached_tokens(server, "key-b") == 0
    assert cached_tokens(server, "key-a") == 96
    assert cached_tokens(server, "key-b") == 96
    # A client's cache_salt separates within its key's scope too.
    assert cached_tokens(server, "key-a", salt="tenant") == 0
    assert cached_tokens(server, "key-a", salt="tenant") == 96


def test_the_cache_is_shared_across_keys_when_the_operator_says_so(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    log_dir = tmp_path_factory.mktemp("serve-shared")
    with transformers_server(model_dir, log_dir, *keys, "--no-cache-salt-by-key") as process:
        assert cached_tokens(process, "key-a") == 0
        assert cached_tokens(process, "key-b") == 96
