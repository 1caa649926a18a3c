"""``/weights_checker`` (and vLLM's ``/weight_checker``) with SGLang's actions over the sample
engine: a snapshot, a reset of every tensor, a compare that names what differs, and a
push that puts the snapshot's weights back."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize("path", ["/weights_checker", "/weight_checker"])
async def test_snapshot_reset_tensors_compare_and_push_back(
    client: httpx.AsyncClient, path: str
) -> None:
    async def check(action: str) -> httpx.Response:
        return await client.post(path, json={"action": action})

    snapshot = await check("snapshot")
    assert snapshot.status_code == 200 and snapshot.json()["success"] is True
    same = await check("compare")
    assert same.status_code == 200 and same.json()["match"] is True

    reset = await check("reset_tensors")
    assert reset.status_code == 200 and reset.json()["success"] is True
    assert reset.json()["checksum"] != snapshot.json()["checksum"]
    differs = await check("compare")
    assert differs.status_code == 400
    error = differs.json()["error"]
    assert error["code"] == "weights_mismatch" and error["success"] is False
    assert error["mismatches"] == ["token_shift"] and "token_shift" in error["message"]

    assert (await client.post("/pause_generation", json={"mode": "abort"})).status_code == 200
    pushed = await client.post(
        "/update_weights_from_tensor", json={"named_tensors": {"token_shift": [0]}}
    )
    assert pushed.status_code == 200
    assert (await client.post("/continue_generation")).status_code == 200
    restored = await check("compare")
    assert restored.status_code == 200 and restored.json()["match"] is True


async def test_compare_without_a_snapshot_and_unknown_actions(client: httpx.AsyncClient) -> None:
    assert (await client.post("/weights_checker", json={"action": "reset"})).status_code == 200
    missing = await client.post("/weights_checker", json={"action": "compare"})
    assert missing.status_code == 409 and missing.json()["error"]["code"] == "no_baseline"
    unknown = await client.post("/weights_checker", json={"action": "nonsense"})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "action"
    assert "Unsupported" in unknown.json()["error"]["message"]


async def test_a_whole_model_checksum_baseline_is_compared_too(client: httpx.AsyncClient) -> None:
    summed = (await client.post("/weights_checker", json={"action": "checksum"})).json()
    same = await client.post(
        "/weights_checker", json={"action": "compare", "baseline": summed["checksum"]}
    )
    assert same.status_code == 200 and same.json()["match"] is True
    other = await client.post("/weights_checker", json={"action": "compare", "baseline": "0" * 64})
    assert other.status_code == 400 and "checksum differs" in other.json()["error"]["message"]
