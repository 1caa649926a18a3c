"""A LoRA adapter on a real ``penstock serve --engine transformers``: loaded over vLLM's
route, listed as a model, used through the official client, then unloaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engines.transformers.conftest import peft_greedy, save_tiny_lora
from tests.support.server import ServerProcess, transformers_server
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "k"
MAX_TOKENS = 12
ADAPTER = "tiny-lora"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return save_tiny_lora(model_dir, tmp_path_factory.mktemp("tiny-lora"), seed=21)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    with transformers_server(
        model_dir, tmp_path_factory.mktemp("serve"), "--admin-api-key", ADMIN_KEY
    ) as process:
        yield process


def admin_post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{path}",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=60,
    )


def complete(client: openai.OpenAI, model: str) -> tuple[list[int], list[int]]:
    """``(prompt token ids, completion token ids)`` of a greedy completion."""
    reply = client.completions.create(
        model=model,
        prompt="The river runs",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    extra = reply.choices[0].model_extra or {}
    return extra["prompt_token_ids"], extra["token_ids"]


def test_adapter_loads_serves_its_own_output_and_unloads(
    server: ServerProcess, model_dir: Path, lora_dir: Path
) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    base_name = client.models.list().data[0].id
    prompt, base_tokens = complete(client, base_name)

    loaded = admin_post(
        server, "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(lora_dir)}
    )
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == f"Success: LoRA adapter '{ADAPTER}' added successfully."
    listed = {model.id: model for model in client.models.list().data}
    assert ADAPTER in listed
    assert (listed[ADAPTER].model_extra or {}).get("parent") == base_name

    _, adapter_tokens = complete(client, ADAPTER)
    assert adapter_tokens == peft_greedy(model_dir, lora_dir, prompt, MAX_TOKENS)
    assert adapter_tokens != base_tokens
    chat = client.chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == ADAPTER
    assert complete(client, base_name)[1] == base_tokens

    wrong = admin_post(
        server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(model_dir)}
    )
    assert wrong.status_code == 400
    assert "adapter_config.json" in wrong.json()["error"]["message"]

    unloaded = admin_post(server, "/v1/unload_lora_adapter", {"lora_name": ADAPTER})
    assert unloaded.status_code == 200, unloaded.text
    assert ADAPTER not in {model.id for model in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, ADAPTER)
    assert complete(client, base_name)[1] == base_tokens
