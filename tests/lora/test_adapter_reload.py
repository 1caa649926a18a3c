"""Reloading a loaded LoRA adapter name in place, on the sample engine: the engine-side
slots it alternates between, and what a reload can't do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from penstock.gateway import Gateway
from tests.lora.test_adapter_routes import completion_tokens, write_adapter


async def load(client: httpx.AsyncClient, name: str, folder: Path, **extra: Any) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(folder), **extra}
    return await client.post("/v1/load_lora_adapter", json=body)


async def test_reloads_alternate_slots_and_unload_clears_both(
    client: httpx.AsyncClient, gateway: Gateway, tmp_path: Path
) -> None:
    engine = gateway.host.engine
    assert (await load(client, "math", write_adapter(tmp_path / "a", 50))).status_code == 200
    for step, shift in enumerate((70, 90, 110)):
        folder = write_adapter(tmp_path / f"step{step}", shift)
        assert (await load(client, "math", folder, load_inplace=True)).status_code == 200
        expected = [engine.token_at(s, 0, shift) for s in range(4)]
        assert await completion_tokens(client, "math") == expected
        listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert listed.count("math") == 1 and "math#reloaded" not in listed
        loras = (await client.get("/v1/loras")).json()["loras"]
        assert [(lora["lora_name"], lora["local_path"]) for lora in loras] == [
            ("math", str(folder))
        ]
    assert (
        await client.post("/v1/unload_lora_adapter", json={"lora_name": "math"})
    ).status_code == 200
    # Both slots are gone from the engine: the replaced one and the last one loaded.
    assert engine.adapters == {}


async def test_a_served_name_in_the_reload_slot_is_a_409(
    client: httpx.AsyncClient, gateway: Gateway, tmp_path: Path
) -> None:
    engine = gateway.host.engine
    assert (
        await load(client, "math#reloaded", write_adapter(tmp_path / "x", 5))
    ).status_code == 200
    assert (await load(client, "math", write_adapter(tmp_path / "a", 50))).status_code == 200
    refused = await load(client, "math", write_adapter(tmp_path / "b", 60), load_inplace=True)
    assert refused.status_code == 409
    assert "math#reloaded" in refused.json()["error"]["message"]
    # The refused reload left the loaded adapter served.
    assert await completion_tokens(client, "math") == [engine.token_at(s, 0, 50) for s in range(4)]
