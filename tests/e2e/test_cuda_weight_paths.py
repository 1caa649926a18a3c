"""The CUDA weight paths on a server without CUDA: ``penstock serve --engine transformers
--trust-weight-payloads`` on the CPU, sent SGLang's exact bodies.

An ``init_weights_update_group`` asking for ``nccl`` is a 400 saying gloo is what this
engine can join, and a gloo group joins right after it; an ``update_weights_from_tensor``
of CUDA-IPC handles, shaped as verl and slime send them from a colocated trainer, is a
400 naming the reason. Neither changes the weights, and the server keeps generating.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from penstock.rl.trainer import WeightPusher
from tests.support.cuda_payloads import verl_cuda_payload
from tests.support.server import ServerProcess, free_port, transformers_server
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "trainer-key"
PROMPT = [5, 17, 29, 41]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    with transformers_server(
        model,
        tmp_path_factory.mktemp("serve"),
        "--admin-api-key",
        ADMIN_KEY,
        "--trust-weight-payloads",
        engine_args=("--device", "cpu"),
    ) as process:
        yield process


@pytest.fixture
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client:
        yield client


def greedy(client: httpx.Client) -> list[int]:
    reply = client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
    )
    assert reply.status_code == 200, reply.text
    ids: list[int] = reply.json()["output_ids"]
    return ids


def checksum(client: httpx.Client) -> str:
    reply = client.post("/weights_checker", json={"action": "checksum"})
    assert reply.status_code == 200, reply.text
    value: str = reply.json()["checksum"]
    return value


def error_message(reply: httpx.Response) -> str:
    body: dict[str, Any] = reply.json()
    message: str = body["error"]["message"]
    return message


def test_an_nccl_group_is_refused_and_a_gloo_group_joins_after(
    server: ServerProcess, admin: httpx.Client
) -> None:
    reply = admin.post(
        "/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "weight_update_group",
            "backend": "nccl",
        },
    )
    assert reply.status_code == 400
    message = error_message(reply)
    assert "nccl needs the engine on CUDA" in message
    assert "gloo is the backend it can join" in message
    pusher = WeightPusher(server.base_url, admin_key=ADMIN_KEY)
    try:
        joined = pusher.init_group("127.0.0.1", free_port(), backend="gloo", timeout_s=20)
        assert "(gloo)" in joined["message"]
        pusher.destroy_group()
    finally:
        pusher.close()


def test_a_cuda_ipc_push_is_refused_and_the_weights_keep_serving(admin: httpx.Client) -> None:
    before, served = checksum(admin), greedy(admin)
    assert admin.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    try:
        reply = admin.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [verl_cuda_payload()],
                "load_format": None,
                "flush_cache": True,
                "weight_version": "ipc",
            },
        )
    finally:
        assert admin.post("/continue_generation", json={}).status_code == 200
    assert reply.status_code == 400
    message = error_message(reply)
    assert "CUDA tensors shared by IPC handle" in message
    assert "this engine runs on cpu" in message
    assert checksum(admin) == before
    assert greedy(admin) == served
    version = admin.get("/get_weight_version")
    assert version.status_code == 200
    assert version.json().get("weight_version") != "ipc"
