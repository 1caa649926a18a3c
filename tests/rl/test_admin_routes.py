"""The ``/engine/*`` routes and the SGLang / vLLM dialects over HTTP (in-process ASGI)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from penstock.engines.samples.engine import write_sample_weights
from penstock.engines.weights.sync import nixl_pull_body, weights_checksum
from penstock.nixl_agent import NixlAgent
from tests.support.inprocess import asgi_client, start_gateway


async def test_capabilities_lists_controls_updates_routes_state_and_version(
    client: httpx.AsyncClient,
) -> None:
    body = (await client.get("/engine/capabilities")).json()
    assert body["object"] == "engine.capabilities"
    assert "pause_generation" in body["controls"] and "load_lora" in body["updates"]
    assert len(body["rl_routes"]) == 17 and "update_weights_from_nixl" in body["rl_routes"]
    assert body["state"]["state"] == "serving" and body["weight_version"] is None
    assert body["lora"]["supported"] is True and body["lora"]["schemes"] == ["file", "hf", "s3"]
    assert (
        "/pause" in body["dialects"]["vllm"] and "/pause_generation" in body["dialects"]["sglang"]
    )


@pytest.mark.parametrize(
    ("path", "listed"),
    [
        ("/engine/control/nope", "pause_generation"),
        ("/engine/update/nope", "update_weights_from_disk"),
        ("/engine/nope", "liveness_probe"),
    ],
)
async def test_unknown_names_are_404_listing_what_is_supported(
    client: httpx.AsyncClient, path: str, listed: str
) -> None:
    response = await client.post(path, json={})
    assert response.status_code == 404
    error = response.json()["error"]
    assert listed in error["message"] and listed in error["supported"]


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"7"])
async def test_a_body_that_is_not_an_object_is_400(client: httpx.AsyncClient, body: bytes) -> None:
    for path in (
        "/engine/control/pause_generation",
        "/engine/pause_generation",
        "/pause_generation",
    ):
        response = await client.post(path, content=body)
        assert response.status_code == 400, path
        assert response.json()["error"]["message"] == "request body must be a JSON object"


async def test_invalid_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/engine/flush_cache", content=b"{nope")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/engine/pause_generation", {"mode": 1}, "mode"),
        ("/engine/pause_generation", {"clear_cache": "yes"}, "clear_cache"),
        ("/engine/control/sleep", {"level": "1"}, "level"),
        ("/engine/control/wake_up", {"tags": ["gpu"]}, "tags"),
        ("/engine/set_weight_version", {"weight_version": 3}, "weight_version"),
        ("/engine/update_weights_from_disk", {"model_path": ["x"]}, "model_path"),
        ("/engine/abort_request", {"request_id": 5}, "request_id"),
        ("/engine/update_weights_from_distributed", {"allow_unpaused": 1}, "allow_unpaused"),
        ("/update_weight_version", {"new_version": None}, "new_version"),
        ("/abort_requests", {"request_ids": "a"}, "request_ids"),
        ("/engine/load_lora", {"lora_name": "a", "source": {"uri": 1}}, "source.uri"),
    ],
)
async def test_wrong_field_types_are_400_naming_the_field(
    client: httpx.AsyncClient, path: str, body: dict, field: str
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


async def test_missing_rl_fields_use_the_rl_messages(client: httpx.AsyncClient) -> None:
    abort = await client.post("/engine/abort_request", json={})
    assert abort.json()["error"]["message"] == "Missing 'request_id' in body"
    version = await client.post("/engine/set_weight_version")
    assert version.json()["error"]["message"] == "Missing 'weight_version' in body"


async def test_invalid_transition_is_409_with_the_state(client: httpx.AsyncClient) -> None:
    assert (await client.post("/engine/control/pause_generation", json={"mode": "keep"})).is_success
    again = await client.post("/pause?mode=abort")
    assert again.status_code == 409
    error = again.json()["error"]
    assert error["state"] == "paused" and error["admin"]["mode"] == "keep"
    repeat = await client.post("/engine/pause_generation", json={"mode": "keep"})
    assert repeat.status_code == 200 and repeat.json()["changed"] is False


async def test_rl_route_shapes(client: httpx.AsyncClient, tmp_path: Path) -> None:
    live = (await client.post("/engine/liveness_probe")).json()
    assert live == {"status": "ok", "alive": True, "state": "serving"}
    flushed = (await client.get("/engine/flush_cache")).json()
    assert flushed["message"] == "Cache flushed" and flushed["status"] == "ok"
    aborted = (await client.post("/engine/abort_request", json={"request_id": "r1"})).json()
    assert aborted == {"status": "ok", "request_id": "r1", "aborted": False, "state": "serving"}
    version = (await client.get("/engine/get_weight_version")).json()
    assert version == {
        "status": "ok",
        "version": None,
        "version_declared": False,
        "state": "serving",
    }
    paused = (await client.post("/engine/pause_generation")).json()
    assert paused["mode"] == "keep" and paused["message"] == "Engine paused"
    write_sample_weights(tmp_path, 3)
    updated = await client.post(
        "/engine/update_weights_from_tensor", json={"named_tensors": {"token_shift": [3]}}
    )
    assert updated.json()["status"] == "ok"
    unsupported = await client.post("/engine/update_weights_from_distributed", json={})
    assert unsupported.status_code == 400 and "does not support" in unsupported.text
    group = await client.post("/engine/init_weights_update_group", json={})
    assert group.status_code == 400
    resumed = (await client.post("/engine/resume_generation")).json()
    assert resumed == {
        "status": "ok",
        "message": "Engine resumed",
        "changed": True,
        "state": "serving",
    }


async def test_vllm_dialect_shapes(client: httpx.AsyncClient) -> None:
    assert (await client.get("/is_paused")).json() == {"is_paused": False}
    assert (await client.post("/pause?mode=keep")).json() == {"status": "paused", "mode": "keep"}
    assert (await client.get("/is_paused")).json() == {"is_paused": True}
    assert (await client.post("/resume")).json() == {"status": "resumed"}
    slept = (await client.post("/sleep?level=1")).json()
    assert slept == {"status": "sleeping", "level": 1, "tags": ["kv_cache", "weights"]}
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "sleeping"
    assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
    partial = (await client.post("/wake_up?tags=weights")).json()
    assert partial == {"status": "partially_awake", "is_sleeping": True, "tags": ["kv_cache"]}
    assert (await client.post("/wake_up")).json() == {"status": "awake"}
    assert (await client.get("/health")).status_code == 200
    assert (await client.post("/reset_prefix_cache")).json() == {"status": "ok"}
    assert (await client.post("/abort_requests", json={})).json() == {
        "status": "aborted",
        "aborted": 0,
    }
    assert (await client.get("/weight_info")).json() == {"weight_version": None}


async def test_sglang_dialect_shapes(client: httpx.AsyncClient, tmp_path: Path) -> None:
    paused = (await client.post("/pause_generation", json={"mode": "retract"})).json()
    assert paused == {
        "status": "ok",
        "message": "Generation paused successfully.",
        "mode": "retract",
        "state": "paused",
    }
    weights = write_sample_weights(tmp_path, 9)
    updated = await client.post(
        "/update_weights_from_disk", json={"model_path": str(weights), "weight_version": "s1"}
    )
    checksum = (await client.post("/weights_checker", json={"action": "checksum"})).json()
    assert updated.json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
        "weight_version": "s1",
        "checksum": checksum["checksum"],
    }
    assert (await client.get("/get_weight_version")).json() == {"weight_version": "s1"}
    continued = (await client.post("/continue_generation")).json()
    assert continued["state"] == "serving" and continued["status"] == "ok"
    version = (await client.post("/update_weight_version", json={"new_version": "s2"})).json()
    assert version == {
        "success": True,
        "message": "Weight version updated to s2",
        "new_version": "s2",
    }
    flushed = await client.get("/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    assert (await client.post("/abort_request", json={"abort_all": True})).json() == {
        "status": "ok",
        "aborted": [],
    }
    released = (await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})).json()
    assert released["tags"] == ["kv_cache"] and released["state"] == "sleeping"
    resumed = (await client.post("/resume_memory_occupation")).json()
    assert resumed["is_sleeping"] is False and resumed["state"] == "serving"
    info = (await client.get("/get_model_info")).json()
    assert info["is_generation"] is True and info["weight_version"] == "s2"
    server = (await client.get("/get_server_info")).json()
    assert server["admin"]["state"] == "serving" and server["context_length"] == 2048


async def test_admin_keys_gate_every_dialect() -> None:
    gateway = await start_gateway(api_keys=["inference"], admin_api_keys=["admin"])
    try:
        async for http in asgi_client(gateway):
            for path in ("/engine/capabilities", "/is_paused", "/get_weight_version", "/v1/loras"):
                assert (await http.get(path)).status_code == 401, path
                wrong = await http.get(path, headers={"Authorization": "Bearer inference"})
                assert wrong.status_code == 403, path
                right = await http.get(path, headers={"Authorization": "Bearer admin"})
                assert right.status_code == 200, path
    finally:
        await gateway.host.cleanup()


async def test_without_an_admin_key_admin_routes_are_loopback_only() -> None:
    gateway = await start_gateway()
    try:
        async for remote in asgi_client(gateway, client=("203.0.113.9", 5000)):
            refused = await remote.post("/engine/pause_generation")
            assert refused.status_code == 403 and "loopback" in refused.json()["error"]["message"]
            assert (await remote.get("/health")).status_code == 200
    finally:
        await gateway.host.cleanup()


async def test_vllm_pause_sleep_and_wake_take_a_json_body_like_the_query_string(
    client: httpx.AsyncClient,
) -> None:
    paused = await client.post("/pause", json={"mode": "keep"})
    assert paused.json() == {"status": "paused", "mode": "keep"}
    assert (await client.post("/resume")).json() == {"status": "resumed"}
    slept = (await client.post("/sleep", json={"level": 0, "mode": "abort"})).json()
    assert slept == {"status": "sleeping", "level": 0, "tags": ["kv_cache"]}
    more = (await client.post("/sleep?level=1", json={"tags": ["weights"]})).json()
    assert more["tags"] == ["kv_cache", "weights"]
    partial = (await client.post("/wake_up", json={"tags": ["weights"]})).json()
    assert partial == {"status": "partially_awake", "is_sleeping": True, "tags": ["kv_cache"]}
    bad = await client.post("/wake_up", json={"tags": ["gpu"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
    assert (await client.post("/wake_up", json={})).json() == {"status": "awake"}
    wrong = await client.post("/sleep", json={"level": 7})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "level"


async def test_a_safetensors_push_updates_the_sample_engine_and_its_checksum() -> None:
    import base64

    import numpy as np
    import safetensors.numpy

    gateway = await start_gateway()
    try:
        async for client in asgi_client(gateway):
            before = (await client.post("/weights_checker", json={"action": "checksum"})).json()
            assert (await client.post("/pause", params={"mode": "abort"})).status_code == 200
            weights = safetensors.numpy.save({"token_shift": np.array([3], dtype=np.int64)})
            pushed = await client.post(
                "/update_weights_from_tensor",
                json={
                    "serialized_named_tensors": [base64.b64encode(weights).decode()],
                    "weight_version": "v9",
                },
            )
            assert pushed.status_code == 200, pushed.text
            assert pushed.json()["weight_version"] == "v9"
            after = (await client.post("/weights_checker", json={"action": "checksum"})).json()
            assert after["checksum"] == pushed.json()["checksum"] != before["checksum"]
    finally:
        await gateway.host.cleanup()


async def test_sample_engine_reads_its_weights_over_nixl(client: httpx.AsyncClient) -> None:
    trainer = NixlAgent("test-trainer")
    shift = {"token_shift": torch.tensor([7], dtype=torch.int64)}
    registration = trainer.agent.register_memory(list(shift.values()))
    body = {**nixl_pull_body(trainer.name, trainer.metadata(), shift), "weight_version": "n1"}
    try:
        refused = await client.post("/update_weights_from_nixl", json=body)
        assert refused.status_code == 409 and "pause" in refused.json()["error"]["message"]
        await client.post("/pause_generation", json={"mode": "retract"})
        wrong = {**body, "dtypes": ["float64"]}
        bad = await client.post("/update_weights_from_nixl", json=wrong)
        assert bad.status_code == 400 and "dtype" in bad.json()["error"]["message"]
        updated = (await client.post("/update_weights_from_nixl", json=body)).json()
        assert updated["checksum"] == weights_checksum(shift)[0]
        assert updated["weight_version"] == "n1"
        assert trainer.wait_for(None, body["notify"].encode(), 5)
        read = (await client.get("/get_weights_by_name", params={"name": "token_shift"})).json()
        assert read == [7]
    finally:
        trainer.agent.deregister_memory(registration)
        await client.post("/continue_generation")
