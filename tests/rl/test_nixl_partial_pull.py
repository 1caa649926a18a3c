"""A NIXL weight pull that breaks after bytes moved leaves the served weights as they were.

The transformers engine runs in this process behind the real app; this process is also
the trainer, with its own NIXL agent over UCX. The fault is injected into the real
transfer: the engine's READ runs to the end (the trainer's bytes land in the engine's
staging buffers), then reports failure, as a READ that broke part-way does. The live
parameters must never see those bytes: the update is a 400 saying none was applied,
the weight version stays, ``/health`` says the server is still paused, and the next
push goes through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from penstock.engines.weights.sync import nixl_pull_body
from penstock.gateway import Gateway
from penstock.nixl_agent import NixlAgent, nixl_installed
from tests.support.inprocess import asgi_client, start_gateway
from tests.support.tiny_llm import build_tiny_llama

pytestmark = pytest.mark.skipif(not nixl_installed(), reason="needs a NIXL package")

NAMES = ("model.norm.weight", "model.layers.0.post_attention_layernorm.weight")


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    model_dir = build_tiny_llama(tmp_path / "served")
    served = await start_gateway(
        engine="transformers", model=str(model_dir), engine_args=["--cpu-threads", "1"]
    )
    try:
        yield served
    finally:
        await served.host.cleanup()


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async for http in asgi_client(gateway):
        yield http


async def served_values(client: httpx.AsyncClient) -> dict[str, Any]:
    values = {}
    for name in NAMES:
        read = await client.post("/get_weights_by_name", json={"name": name})
        assert read.status_code == 200, read.text
        values[name] = read.json()
    return values


def break_after_the_read(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every READ runs, then reports failure; returns what each real READ reported."""
    real = NixlAgent.run_blocking
    outcomes: list[bool] = []

    def run_then_fail(self: NixlAgent, handle: Any) -> bool:
        outcomes.append(real(self, handle))
        return False

    monkeypatch.setattr(NixlAgent, "run_blocking", run_then_fail)
    return outcomes


async def test_a_pull_that_breaks_after_moving_bytes_applies_none(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = await served_values(client)
    trainer = NixlAgent("partial-trainer", progress_thread=True)
    tensors = {name: torch.full((64,), 3.5) for name in NAMES}
    registration = trainer.agent.register_memory(list(tensors.values()))
    body = {**nixl_pull_body(trainer.name, trainer.metadata(), tensors), "weight_version": "n2"}
    try:
        assert (await client.post("/pause_generation", json={"mode": "retract"})).status_code == 200
        outcomes = break_after_the_read(monkeypatch)
        broken = await client.post("/update_weights_from_nixl", json=body)
        assert outcomes == [True], "the READ itself must have moved the bytes"
        assert broken.status_code == 400, broken.text
        message = broken.json()["error"]["message"]
        assert "broke" in message and "none was applied" in message
        assert await served_values(client) == before
        assert (await client.get("/get_weight_version")).json()["weight_version"] is None
        health = await client.get("/health")
        assert health.status_code == 503
        admin = health.json()["admin"]
        assert admin["state"] == "paused" and admin["weight_version"] is None

        monkeypatch.undo()
        pushed = await client.post("/update_weights_from_nixl", json=body)
        assert pushed.status_code == 200, pushed.text
        assert (await client.get("/get_weight_version")).json()["weight_version"] == "n2"
        assert all(
            values[:3] == [3.5, 3.5, 3.5] for values in (await served_values(client)).values()
        )
    finally:
        trainer.agent.deregister_memory(registration)
        await client.post("/continue_generation")
    assert (await client.get("/health")).status_code == 200
