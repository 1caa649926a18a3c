"""Loading a LoRA adapter over HTTP makes it a served model that requests can name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import safetensors.numpy

from penstock.app.server import build_gateway
from penstock.engines.samples.engine import SAMPLE_TOKENIZER_DIR, SampleLLMEngine, WorkerConfig
from penstock.gateway import Gateway
from penstock.settings import Settings
from tests.support.inprocess import asgi_client

MODEL = "sample-model"


def write_adapter(folder: Path, shift: int) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4}))
    tensors = {"token_shift": np.array([shift], dtype=np.int64)}
    safetensors.numpy.save_file(tensors, folder / "adapter_model.safetensors")
    return folder


async def completion_tokens(client: httpx.AsyncClient, model: str) -> list[int]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "return_token_ids": True,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


async def test_a_loaded_adapter_is_listed_and_used_then_unloaded(
    client: httpx.AsyncClient, gateway: Gateway, tmp_path: Path
) -> None:
    engine = gateway.host.engine
    adapter = write_adapter(tmp_path / "math", 50)
    loaded = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": str(adapter)}
    )
    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'math' added successfully."

    models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert models["math"]["parent"] == MODEL
    listing = (await client.get("/v1/loras")).json()
    assert listing["count"] == 1 and listing["loras"][0]["local_path"] == str(adapter)

    assert await completion_tokens(client, MODEL) == [engine.token_at(s, 0) for s in range(4)]
    assert await completion_tokens(client, "math") == [engine.token_at(s, 0, 50) for s in range(4)]

    again = await client.post(
        "/engine/load_lora", json={"lora_name": "math", "source": {"uri": adapter.as_uri()}}
    )
    assert again.status_code == 200 and again.json()["changed"] is False
    other = write_adapter(tmp_path / "other", 1)
    clash = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": str(other)}
    )
    assert clash.status_code == 409

    unloaded = await client.post("/engine/unload_lora", json={"lora_name": "math"})
    assert unloaded.json()["status"] == "success"
    chat = {"model": "math", "messages": [{"role": "user", "content": "hi"}]}
    missing = await client.post("/v1/chat/completions", json=chat)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "math"})
    assert gone.status_code == 404 and "not loaded" in gone.json()["error"]["message"]


async def test_sglang_lora_routes(client: httpx.AsyncClient, tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "code", 7)
    loaded = await client.post(
        "/load_lora_adapter", json={"lora_name": "code", "lora_path": str(adapter)}
    )
    assert loaded.json() == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"code": str(adapter)},
    }
    unloaded = await client.post("/unload_lora_adapter", json={"lora_name": "code"})
    assert unloaded.json()["loaded_adapters"] == {}


async def test_bad_adapter_sources_are_400_naming_the_field(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    missing = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")}
    )
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    (tmp_path / "empty").mkdir()
    empty = await client.post(
        "/engine/load_lora", json={"lora_name": "x", "source": {"uri": "ftp://host/x"}}
    )
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "source.uri"
    taken = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": str(tmp_path / "empty")}
    )
    assert taken.status_code == 409


class NoLoRAEngine(SampleLLMEngine):
    def supported_updates(self) -> set[str]:
        return super().supported_updates() - {"load_lora", "unload_lora"}


async def test_an_engine_without_lora_support_gets_a_clear_400(tmp_path: Path) -> None:
    engine = NoLoRAEngine(MODEL, tokenizer_dir=SAMPLE_TOKENIZER_DIR, delay=0)
    config = WorkerConfig(
        namespace="penstock", model_name=str(SAMPLE_TOKENIZER_DIR), served_model_name=MODEL
    )
    gateway = await build_gateway(Settings(), engine=engine, worker_config=config)
    try:
        async for client in asgi_client(gateway):
            adapter = write_adapter(tmp_path / "a", 1)
            refused = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)}
            )
            assert refused.status_code == 400
            assert "does not support LoRA" in refused.json()["error"]["message"]
            capabilities = (await client.get("/engine/capabilities")).json()
            assert capabilities["lora"]["supported"] is False
    finally:
        await gateway.host.cleanup()
