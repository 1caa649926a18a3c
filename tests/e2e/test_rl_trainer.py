"""A simulated RL trainer drives a real ``penstock serve`` between rollouts.

Sixteen streaming chat requests (the official ``openai`` client) run while the trainer
(httpx, admin key) pauses in each mode, updates the weights from disk, sets a new version
and resumes, each time through a different admin dialect. Every stream must end with
exactly one terminal chunk, carry the version of the weights that produced each token,
and show the new weights' tokens after the update.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import safetensors.numpy

from penstock.engines.samples.engine import (
    SAMPLE_TOKENIZER_DIR,
    SampleLLMEngine,
    write_sample_weights,
)
from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
ADMIN_KEY = "trainer-admin-key"
INFERENCE_KEY = "rollout-key"
ROLLOUTS = 16
LATE_ROLLOUTS = 4
MAX_TOKENS = 30
DEADLINE_S = 30.0


@dataclass
class Trainer:
    """The trainer's view: the server, its admin client and the weights it pushed."""

    server: ServerProcess
    weights_dir: Path
    shifts: dict[str | None, int] = field(default_factory=lambda: {None: 0})
    version: str | None = None

    def admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.server.base_url,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=DEADLINE_S,
        )

    def write_weights(self, name: str, shift: int) -> Path:
        folder = self.weights_dir / name
        folder.mkdir()
        write_sample_weights(folder, shift)
        return folder


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    log_dir = tmp_path_factory.mktemp("rl-trainer")
    args = [
        "--engine",
        "sample",
        "--api-key",
        INFERENCE_KEY,
        "--admin-api-key",
        ADMIN_KEY,
        "--",
        "--delay",
        "0.02",
    ]
    with running_server(args, log_dir) as server:
        yield Trainer(server, tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def reference() -> SampleLLMEngine:
    """The same engine, in the test, to say which token a given shift produces."""
    engine = SampleLLMEngine(MODEL, tokenizer_dir=SAMPLE_TOKENIZER_DIR)
    asyncio.run(engine.start(0))
    return engine


@pytest.fixture
async def rollout_client(trainer: Trainer) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=f"{trainer.server.base_url}/v1",
        api_key=INFERENCE_KEY,
        max_retries=0,
        timeout=DEADLINE_S,
    )
    yield client
    await client.close()


@dataclass
class Rollout:
    request_id: str
    chunks: list[dict[str, Any]] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def choice_chunks(self) -> list[dict[str, Any]]:
        return [chunk for chunk in self.chunks if chunk["choices"]]

    @property
    def terminals(self) -> list[str]:
        return [
            chunk["choices"][0]["finish_reason"]
            for chunk in self.choice_chunks
            if chunk["choices"][0]["finish_reason"] is not None
        ]

    def tokens(self) -> list[tuple[int, str | None]]:
        """(token id, weight version of its chunk) in order."""
        return [
            (token, chunk["weight_version"])
            for chunk in self.choice_chunks
            for token in chunk["choices"][0].get("token_ids") or []
        ]


async def run_rollout(client: openai.AsyncOpenAI, rollout: Rollout) -> Rollout:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"rollout {rollout.request_id}"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"return_token_ids": True},
        extra_headers={"X-Request-Id": rollout.request_id},
    )
    async for chunk in stream:
        data = chunk.to_dict()
        rollout.chunks.append(data)
        if any(choice.get("token_ids") for choice in data["choices"]):
            rollout.started.set()
    return rollout


def assert_one_terminal(rollout: Rollout, reason: str) -> None:
    assert rollout.terminals == [reason], rollout.request_id
    assert rollout.choice_chunks[-1]["choices"][0]["finish_reason"] == reason


def assert_tokens_match_versions(
    rollout: Rollout, trainer: Trainer, reference: SampleLLMEngine
) -> None:
    """Each token is what the weights of its stamped version produce at that step."""
    for step, (token, version) in enumerate(rollout.tokens()):
        assert version in trainer.shifts, (rollout.request_id, version)
        assert token == reference.token_at(step, 0, trainer.shifts[version]), (
            rollout.request_id,
            step,
            version,
        )


async def start_rollouts(
    client: openai.AsyncOpenAI, prefix: str, count: int
) -> tuple[list[Rollout], list[asyncio.Task[Rollout]]]:
    rollouts = [Rollout(f"{prefix}-{i}") for i in range(count)]
    tasks = [asyncio.create_task(run_rollout(client, r)) for r in rollouts]
    return rollouts, tasks


async def finish(tasks: list[asyncio.Task[Rollout]]) -> None:
    """Every rollout ends (none hangs); a failure in any of them fails the test."""
    done = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
    assert len(done) == len(tasks)


async def expect(response: httpx.Response, status: int, keys: set[str]) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == keys, body
    return body


RL_OK_KEYS = {"status", "state"}


async def pause_and_update(
    trainer: Trainer, mode: str, admin: httpx.AsyncClient, weights: Path, version: str
) -> dict[str, Any]:
    """Pause in ``mode``, push weights, set the version; each mode through a dialect."""
    if mode == "abort":
        paused = await expect(
            await admin.post("/engine/pause_generation", json={"mode": "abort"}),
            200,
            RL_OK_KEYS | {"message", "mode", "clear_cache", "changed", "aborted"},
        )
        assert paused["state"] == "paused" and paused["mode"] == "abort"
        updated = await expect(
            await admin.post("/engine/update_weights_from_disk", json={"model_path": str(weights)}),
            200,
            RL_OK_KEYS | {"version", "version_declared", "checksum"},
        )
        assert updated["state"] == "paused" and updated["checksum"]
        labelled = await expect(
            await admin.post("/engine/set_weight_version", json={"weight_version": version}),
            200,
            RL_OK_KEYS | {"version"},
        )
        assert labelled["version"] == version
    elif mode == "wait":
        paused = await expect(await admin.post("/pause?mode=wait"), 200, {"status", "mode"})
        assert paused == {"status": "paused", "mode": "wait"}
        assert (await admin.get("/is_paused")).json() == {"is_paused": True}
        await expect(
            await admin.post(
                "/engine/update/update_weights_from_disk", json={"model_path": str(weights)}
            ),
            200,
            {"status", "model_path", "weight_version", "state", "checksum"},
        )
        labelled = await expect(
            await admin.post("/update_weight_version", json={"new_version": version}),
            200,
            {"success", "message", "new_version"},
        )
        assert labelled["success"] is True and labelled["new_version"] == version
    else:
        paused = await expect(
            await admin.post("/pause_generation", json={"mode": "in_place"}),
            200,
            {"status", "message", "mode", "state"},
        )
        assert paused["state"] == "paused"
        updated = await expect(
            await admin.post("/update_weights_from_disk", json={"model_path": str(weights)}),
            200,
            {"success", "message", "num_paused_requests", "weight_version", "checksum"},
        )
        assert updated["success"] is True and updated["checksum"]
        await expect(
            await admin.post("/engine/update/update_weight_version", json={"new_version": version}),
            200,
            {"success", "new_version", "state"},
        )
    return paused


async def resume(mode: str, admin: httpx.AsyncClient) -> None:
    if mode == "abort":
        resumed = await expect(
            await admin.post("/engine/resume_generation"), 200, RL_OK_KEYS | {"message", "changed"}
        )
        assert resumed["state"] == "serving"
    elif mode == "wait":
        assert (await admin.post("/resume")).json() == {"status": "resumed"}
    else:
        resumed = await expect(
            await admin.post("/continue_generation", json={}),
            200,
            {"status", "message", "state"},
        )
        assert resumed["state"] == "serving"


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_trainer_pauses_updates_and_resumes_without_losing_a_rollout(
    mode: str,
    trainer: Trainer,
    reference: SampleLLMEngine,
    rollout_client: openai.AsyncOpenAI,
) -> None:
    old_version = trainer.version
    new_version = f"step-{mode}"
    new_shift = {"abort": 101, "wait": 202, "keep": 303}[mode]
    weights = trainer.write_weights(mode, new_shift)
    rollouts, tasks = await start_rollouts(rollout_client, mode, ROLLOUTS)
    await asyncio.wait_for(asyncio.gather(*(r.started.wait() for r in rollouts)), DEADLINE_S)

    async with trainer.admin() as admin:
        await pause_and_update(trainer, mode, admin, weights, new_version)
        trainer.shifts[new_version] = new_shift
        trainer.version = new_version

        health = await admin.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "paused"
        assert health.json()["admin"]["mode"] == mode
        assert (await admin.get("/live")).status_code == 200

        late, late_tasks = await start_rollouts(rollout_client, f"{mode}-late", LATE_ROLLOUTS)
        await asyncio.sleep(0.3)
        assert not any(task.done() for task in late_tasks), "requests ran while paused"
        if mode == "keep":
            assert not any(task.done() for task in tasks), "keep mode let frozen requests run"

        await resume(mode, admin)
        await finish(tasks + late_tasks)

        capabilities = (await admin.get("/engine/capabilities")).json()
        assert capabilities["state"]["state"] == "serving"
        assert capabilities["weight_version"] == new_version

    expected_end = {"abort": "abort", "wait": "length", "keep": "length"}[mode]
    for rollout in rollouts:
        assert_one_terminal(rollout, expected_end)
        assert_tokens_match_versions(rollout, trainer, reference)
        versions = [version for _, version in rollout.tokens()]
        if mode == "keep":
            assert len(versions) == MAX_TOKENS
            assert versions[0] == old_version and versions[-1] == new_version
        else:
            assert set(versions) == {old_version}
        if mode == "wait":
            assert len(versions) == MAX_TOKENS
    for rollout in late:
        assert_one_terminal(rollout, "length")
        assert [version for _, version in rollout.tokens()] == [new_version] * MAX_TOKENS
        assert_tokens_match_versions(rollout, trainer, reference)


async def test_a_request_spanning_a_keep_update_reports_each_version_segment(
    trainer: Trainer, reference: SampleLLMEngine
) -> None:
    old_version = trainer.version
    weights = trainer.write_weights("segments", 404)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "segments"}],
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
    }
    headers = {"Authorization": f"Bearer {INFERENCE_KEY}"}
    async with (
        httpx.AsyncClient(base_url=trainer.server.base_url, timeout=DEADLINE_S) as rollouts,
        trainer.admin() as admin,
    ):
        request = asyncio.create_task(
            rollouts.post("/v1/chat/completions", json=body, headers=headers)
        )
        await asyncio.sleep(0.2)
        assert (await admin.post("/pause?mode=keep")).status_code == 200
        update = {"model_path": str(weights), "weight_version": "segments-v"}
        assert (
            await admin.post("/engine/update_weights_from_disk", json=update)
        ).status_code == 200
        trainer.shifts["segments-v"] = 404
        trainer.version = "segments-v"
        assert (await admin.post("/resume")).status_code == 200
        response = await asyncio.wait_for(request, DEADLINE_S)

    assert response.status_code == 200, response.text
    completion = response.json()
    assert completion["weight_version"] == "segments-v"
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "length"
    segments = choice["weight_versions"]
    assert [s["weight_version"] for s in segments] == [old_version, "segments-v"]
    assert segments[0]["start_token"] == 0
    switch = segments[1]["start_token"]
    assert 0 < switch < MAX_TOKENS
    tokens = choice["token_ids"]
    assert tokens[:switch] == [
        reference.token_at(step, 0, trainer.shifts[old_version]) for step in range(switch)
    ]
    assert tokens[switch:] == [
        reference.token_at(step, 0, 404) for step in range(switch, MAX_TOKENS)
    ]


async def test_update_while_serving_is_409_and_a_bad_path_keeps_the_old_weights(
    trainer: Trainer, reference: SampleLLMEngine, rollout_client: openai.AsyncOpenAI
) -> None:
    current = trainer.version
    async with trainer.admin() as admin:
        refused = await admin.post(
            "/engine/update_weights_from_disk", json={"model_path": str(trainer.weights_dir)}
        )
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert "pause" in error["message"] and error["state"] == "serving"

        assert (await admin.post("/engine/pause_generation", json={"mode": "wait"})).is_success
        missing = await admin.post(
            "/engine/update_weights_from_disk",
            json={"model_path": str(trainer.weights_dir / "missing"), "weight_version": "bad"},
        )
        assert missing.status_code == 400
        assert "no weights" in missing.json()["error"]["message"]
        wrong_shape = trainer.weights_dir / "wrong-shape.safetensors"
        safetensors.numpy.save_file({"token_shift": np.array([1, 2], dtype=np.int64)}, wrong_shape)
        mismatched = await admin.post(
            "/engine/update_weights_from_disk", json={"model_path": str(wrong_shape)}
        )
        assert mismatched.status_code == 400
        assert "shape mismatch" in mismatched.json()["error"]["message"]
        version = (await admin.get("/engine/get_weight_version")).json()
        assert version["version"] == current and version["state"] == "paused"
        assert (await admin.post("/engine/resume_generation")).is_success

    rollout = await run_rollout(rollout_client, Rollout("after-bad-update"))
    assert_one_terminal(rollout, "length")
    assert {version for _, version in rollout.tokens()} == {current}
    assert_tokens_match_versions(rollout, trainer, reference)


def test_admin_routes_need_the_admin_key_not_an_inference_key(trainer: Trainer) -> None:
    url = f"{trainer.server.base_url}/engine/capabilities"
    assert httpx.get(url).status_code == 401
    inference = httpx.get(url, headers={"Authorization": f"Bearer {INFERENCE_KEY}"})
    assert inference.status_code == 403
    assert inference.json()["error"]["type"] == "permission_error"
    admin = httpx.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200
    # An admin key is a superset: it also serves inference (and sees every key's media).
    chat = httpx.post(
        f"{trainer.server.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert chat.status_code == 200
