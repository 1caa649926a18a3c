"""Reloading one LoRA adapter name from new weights each step, as prime-rl and SkyRL do,
on a real ``penstock serve --engine transformers``: each reload's greedy output is peft's
for the new folder, a request running across a reload ends with the adapter it began
with, and the name is listed once throughout."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engines.transformers.conftest import peft_greedy, save_tiny_lora
from tests.support.server import ServerProcess, transformers_server
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "k"
ADAPTER = "policy"
PROMPT = [5, 17, 42, 9]
SHORT = 6
LONG = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> list[Path]:
    """Three adapters for the model, as three training steps would write them."""
    root = tmp_path_factory.mktemp("steps")
    return [save_tiny_lora(model_dir, root / f"step_{n}", seed=30 + n) for n in range(3)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("serve")
    with transformers_server(model_dir, log_dir, "--admin-api-key", ADMIN_KEY) as process:
        yield process


@pytest.fixture
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as client:
        yield client


def greedy_body(model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def greedy(admin: httpx.Client, model: str, max_tokens: int = SHORT) -> list[int]:
    reply = admin.post("/v1/completions", json=greedy_body(model, max_tokens))
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["choices"][0]["token_ids"]
    return tokens


def served_names(admin: httpx.Client) -> list[str]:
    return [card["id"] for card in admin.get("/v1/models").json()["data"]]


def test_each_step_reload_serves_the_new_folder(
    admin: httpx.Client, model_dir: Path, steps: list[Path]
) -> None:
    # prime-rl: POST /load_lora_adapter {lora_name, lora_path} with a new folder each step.
    for step in steps:
        loaded = admin.post(
            "/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(step)}
        )
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["success"] is True
        assert greedy(admin, ADAPTER) == peft_greedy(model_dir, step, PROMPT, SHORT)
        assert served_names(admin).count(ADAPTER) == 1
        assert not any("#" in name for name in served_names(admin))
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER}).status_code == 200
    assert ADAPTER not in served_names(admin)


def test_skyrl_reload_rereads_the_same_folder(
    admin: httpx.Client, model_dir: Path, steps: list[Path], tmp_path: Path
) -> None:
    # SkyRL writes each step's adapter over the same folder, then reloads that path.
    folder = tmp_path / "lora_sync"
    shutil.copytree(steps[0], folder)
    body = {"lora_name": ADAPTER, "lora_path": str(folder)}
    first = admin.post("/skyrl/v1/load_lora_adapter", json=body)
    assert first.status_code == 200, first.text
    assert first.json()["status"] == "ok"
    assert greedy(admin, ADAPTER) == peft_greedy(model_dir, steps[0], PROMPT, SHORT)
    shutil.rmtree(folder)
    shutil.copytree(steps[1], folder)
    second = admin.post("/skyrl/v1/load_lora_adapter", json=body)
    assert second.status_code == 200, second.text
    assert second.json()["lora_int_id"] == first.json()["lora_int_id"]
    assert greedy(admin, ADAPTER) == peft_greedy(model_dir, steps[1], PROMPT, SHORT)
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER}).status_code == 200


def test_vllm_route_replaces_only_with_load_inplace(
    admin: httpx.Client, model_dir: Path, steps: list[Path]
) -> None:
    path = "/v1/load_lora_adapter"
    assert (
        admin.post(path, json={"lora_name": ADAPTER, "lora_path": str(steps[0])}).status_code == 200
    )
    refused = admin.post(path, json={"lora_name": ADAPTER, "lora_path": str(steps[1])})
    assert refused.status_code == 409
    assert "load_inplace" in refused.json()["error"]["message"]
    assert greedy(admin, ADAPTER) == peft_greedy(model_dir, steps[0], PROMPT, SHORT)
    replaced = admin.post(
        path, json={"lora_name": ADAPTER, "lora_path": str(steps[1]), "load_inplace": True}
    )
    assert replaced.status_code == 200, replaced.text
    assert greedy(admin, ADAPTER) == peft_greedy(model_dir, steps[1], PROMPT, SHORT)
    bad = admin.post(
        path, json={"lora_name": ADAPTER, "lora_path": str(model_dir), "load_inplace": True}
    )
    assert bad.status_code == 400
    # A reload that fails leaves the adapter it would have replaced.
    assert greedy(admin, ADAPTER) == peft_greedy(model_dir, steps[1], PROMPT, SHORT)
    wrong_type = admin.post(
        path, json={"lora_name": ADAPTER, "lora_path": str(steps[2]), "load_inplace": "yes"}
    )
    assert wrong_type.status_code == 400
    assert wrong_type.json()["error"]["param"] == "load_inplace"
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER}).status_code == 200


def test_a_request_running_across_a_reload_keeps_its_adapter(
    admin: httpx.Client, server: ServerProcess, model_dir: Path, steps: list[Path]
) -> None:
    load = {"lora_name": ADAPTER, "lora_path": str(steps[0])}
    assert admin.post("/load_lora_adapter", json=load).status_code == 200
    tokens: list[int] = []
    body = greedy_body(ADAPTER, LONG, stream=True)
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    break
            # Frozen where it is, so the reload lands while it runs.
            assert admin.post("/pause", params={"mode": "keep"}).status_code == 200
            (load,) = admin.get("/v1/loads").json()["loads"]
            assert load["num_reqs"] == 1
            reload = {"lora_name": ADAPTER, "lora_path": str(steps[1])}
            assert admin.post("/load_lora_adapter", json=reload).status_code == 200
            # The next reload needs the frozen request's slot: refused, nothing changes.
            early = {"lora_name": ADAPTER, "lora_path": str(steps[2])}
            refused = admin.post("/load_lora_adapter", json=early)
            assert refused.status_code == 400, refused.text
            assert "paused" in refused.json()["error"]["message"]
            assert admin.post("/resume").status_code == 200
            for line in lines:
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    assert tokens == peft_greedy(model_dir, steps[0], PROMPT, LONG)
    assert greedy(admin, ADAPTER) == peft_greedy(model_dir, steps[1], PROMPT, SHORT)
    # The slot the running request held is free again for the next step's reload.
    third = {"lora_name": ADAPTER, "lora_path": str(steps[2])}
    assert admin.post("/load_lora_adapter", json=third).status_code == 200
    assert greedy(admin, ADAPTER) == peft_greedy(model_dir, steps[2], PROMPT, SHORT)
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER}).status_code == 200
    assert ADAPTER not in served_names(admin)
