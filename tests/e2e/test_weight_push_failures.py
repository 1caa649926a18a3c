"""Weight pushes at their edges, against a real ``penstock serve --engine transformers
--trust-weight-payloads`` on the tiny Llama.

A real trainer process (``tests/support/broadcast_trainer.py``) starts a broadcast and is
SIGKILLed between two tensors: the update fails saying nothing was applied, the served
weights are exactly the old ones (checksum and greedy output), the version stays, and the
server keeps generating once resumed. A pickled payload as SGLang's
``MultiprocessingSerializer`` makes it (``ForkingPickler``, the tensor in shared memory)
updates the weights on a server that trusts payloads.
"""

from __future__ import annotations

import base64
import concurrent.futures
import signal
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from penstock.rl.trainer import EngineRefused, WeightPusher, broadcast_body
from tests.support.broadcast_trainer import checkpoint_tensors
from tests.support.server import (
    REPO_ROOT,
    ServerProcess,
    free_port,
    transformers_server,
)
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "trainer-key"
PROMPT = [5, 17, 29, 41]
GREEDY_TOKENS = 8
# Tensors the dying trainer sends before it is killed (of the tiny Llama's 21).
SENT_BEFORE_DEATH = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    with transformers_server(
        model_dir,
        tmp_path_factory.mktemp("serve"),
        "--admin-api-key",
        ADMIN_KEY,
        "--admin-timeout-s",
        "25",
        "--trust-weight-payloads",
    ) as process:
        yield process


@pytest.fixture
def pusher(server: ServerProcess) -> Iterator[WeightPusher]:
    client = WeightPusher(server.base_url, admin_key=ADMIN_KEY, timeout_s=30)
    yield client
    client.close()


def greedy(server: ServerProcess) -> dict[str, Any]:
    reply = httpx.post(
        f"{server.base_url}/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": GREEDY_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def served_checksum(pusher: WeightPusher) -> str:
    return str(pusher.post("/weights_checker", {"action": "checksum"})["checksum"])


def served_version(pusher: WeightPusher) -> str | None:
    response = pusher.http.get("/get_weight_version")
    assert response.status_code == 200, response.text
    version: str | None = response.json()["weight_version"]
    return version


def admin_health(server: ServerProcess) -> dict[str, Any]:
    admin: dict[str, Any] = httpx.get(f"{server.base_url}/health").json()["admin"]
    return admin


def test_a_trainer_killed_mid_broadcast_leaves_the_old_weights_serving(
    server: ServerProcess, pusher: WeightPusher, model_dir: Path
) -> None:
    before_checksum = served_checksum(pusher)
    before_output = greedy(server)["output_ids"]
    before_version = served_version(pusher)
    tensors = checkpoint_tensors(model_dir)
    assert len(tensors) > SENT_BEFORE_DEATH + 1
    port = free_port()
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.broadcast_trainer",
            str(model_dir),
            "--port",
            str(port),
            "--stop-after",
            str(SENT_BEFORE_DEATH),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pusher.post(
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "backend": "gloo",
                "timeout_s": 20,
            },
        )
        pusher.pause("retract")
        body = broadcast_body(tensors, weight_version="never-applied")
        answered = pool.submit(pusher.post, "/update_weights_from_distributed", body)
        assert trainer.stdout is not None
        said = []
        for line in trainer.stdout:
            if line.strip() == "holding":
                break
            said.append(line.strip())
        first_sent = [f"sent {name}" for name in list(tensors)[:SENT_BEFORE_DEATH]]
        assert said == ["joined", *first_sent]
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
        with pytest.raises(EngineRefused) as failed:
            answered.result(timeout=30)
        assert failed.value.status_code == 400
        message = failed.value.body["error"]["message"]
        assert "broadcast broke" in message and "none was applied" in message, message
        assert served_checksum(pusher) == before_checksum
        assert served_version(pusher) == before_version
        admin = admin_health(server)
        assert admin["state"] == "paused" and admin["weight_version"] == before_version
        pusher.post("/destroy_weights_update_group", {})
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    pusher.resume()
    after = greedy(server)
    assert after["output_ids"] == before_output
    assert after["meta_info"]["weight_version"] == before_version


def pickled(tensors: list[tuple[str, torch.Tensor]], strategy: str) -> str:
    """What SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` sends:
    the tensors' storage moves to shared memory, shared under torch's ``strategy``."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        return base64.b64encode(ForkingPickler.dumps(tensors)).decode()
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def test_a_trusted_pickled_payload_updates_the_weights(
    server: ServerProcess, pusher: WeightPusher
) -> None:
    current = pusher.post("/engine/get_weights_by_name", {"name": "lm_head.weight"})
    vocab, hidden = current["shape"]
    head = torch.linspace(-1.0, 1.0, vocab * hidden).reshape(vocab, hidden)
    pusher.pause("retract")
    try:
        by_descriptor = torch.zeros(vocab, hidden)
        with pytest.raises(EngineRefused) as refused:
            pusher.post(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [
                        pickled([("lm_head.weight", by_descriptor)], "file_descriptor")
                    ]
                },
            )
        assert refused.value.status_code == 400
        assert "file_system" in refused.value.body["error"]["message"]
        reply = pusher.post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [pickled([("lm_head.weight", head)], "file_system")],
                "weight_version": "pickled",
            },
        )
    finally:
        pusher.resume()
    assert reply["weight_version"] == "pickled"
    assert reply["checksum"] == pusher.checksum({"lm_head.weight": head})
    served = pusher.http.get(
        "/get_weights_by_name", params={"name": "lm_head.weight", "truncate_size": 2}
    ).json()
    # SGLang's slice: the parameter's first rows.
    assert [pytest.approx(row) for row in served] == head[:2].tolist()
    assert greedy(server)["meta_info"]["weight_version"] == "pickled"
