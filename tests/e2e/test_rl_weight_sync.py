"""A real trainer (this process: torch, the tiny Llama, an optimizer) pushes its weights
into a real ``penstock serve --engine transformers`` after each step, by gloo broadcast,
by tensors and by NIXL (the engine READs the trainer's memory), while 16 streaming
requests run through pause/resume.

After each push the engine's greedy ``/generate`` equals the trainer's own greedy
forward, the checksums match, and every stream ends with one terminal and its version.
Bad pushes are 400 and the old weights keep serving; a trainer that never joins the
group fails the init within its timeout; an update while serving is 409.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from transformers import LlamaForCausalLM

from penstock.engines.weights.sync import nixl_pull_body
from penstock.nixl_agent import NixlAgent
from penstock.rl.trainer import EngineRefused, WeightPusher
from tests.support.server import ServerProcess, free_port, transformers_server
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "trainer-key"
ROLLOUTS = 16
PROMPT = [5, 17, 29, 41]
GREEDY_TOKENS = 8
ADMIN_TIMEOUT_S = 6


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
        str(ADMIN_TIMEOUT_S),
        engine_args=("--max-num-seqs", "16"),
    ) as process:
        yield process


@pytest.fixture(scope="module")
def pusher(server: ServerProcess) -> Iterator[WeightPusher]:
    client = WeightPusher(server.base_url, admin_key=ADMIN_KEY)
    client.init_group("127.0.0.1", free_port(), timeout_s=20)
    yield client
    client.destroy_group()
    client.close()


def trainer_greedy(model: LlamaForCausalLM) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            min_new_tokens=GREEDY_TOKENS,
        )
    return [int(t) for t in out[0, len(PROMPT) :]]


def engine_greedy(server: ServerProcess) -> dict[str, Any]:
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


async def rollout(base_url: str, index: int) -> list[dict[str, Any]]:
    events = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        async with http.stream(
            "POST",
            "/generate",
            json={
                "input_ids": [3 + index, 7, 11],
                "sampling_params": {"max_new_tokens": 24, "ignore_eos": True},
                "stream": True,
            },
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(orjson.loads(line.removeprefix("data: ")))
    return events


def train_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    batch = torch.randint(0, model.config.vocab_size, (2, 12))
    loss = model(batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in model.state_dict().items()}


async def test_trainer_pushes_after_each_step_while_rollouts_stream(
    server: ServerProcess, pusher: WeightPusher, model_dir: Path
) -> None:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    assert engine_greedy(server)["output_ids"] == trainer_greedy(model)
    seen = {pusher.checksum(state(model))}
    rollouts = [asyncio.create_task(rollout(server.base_url, i)) for i in range(ROLLOUTS)]
    await asyncio.sleep(0.3)
    for step, method in enumerate(("broadcast", "flattened", "tensors", "nixl"), start=1):
        train_step(model, optimizer, step)
        version = f"step-{step}"
        await asyncio.to_thread(pusher.pause, "retract")
        weights = state(model)
        if method == "tensors":
            reply = await asyncio.to_thread(pusher.push_tensors, weights, weight_version=version)
        elif method == "nixl":
            reply = await asyncio.to_thread(pusher.push_nixl, weights, weight_version=version)
        else:
            reply = await asyncio.to_thread(
                pusher.broadcast, weights, weight_version=version, flattened=method == "flattened"
            )
        assert reply["weight_version"] == version
        assert reply["checksum"] == pusher.checksum(weights)
        assert reply["checksum"] not in seen
        seen.add(reply["checksum"])
        await asyncio.to_thread(pusher.resume)
        greedy = engine_greedy(server)
        assert greedy["meta_info"]["weight_version"] == version
        assert greedy["output_ids"] == trainer_greedy(model), method
        checked = pusher.post("/weights_checker", {"action": "checksum"})
        assert checked["checksum"] == pusher.checksum(weights)
    results = await asyncio.gather(*rollouts)
    for events in results:
        finals = [e for e in events if e["meta_info"]["finish_reason"] is not None]
        assert len(finals) == 1 and events[-1] is finals[0]
        assert finals[0]["meta_info"]["finish_reason"]["type"] == "length"
        assert len(finals[0]["output_ids"]) == 24
        assert finals[0]["meta_info"]["weight_version"] in {
            None,
            "step-1",
            "step-2",
            "step-3",
            "step-4",
        }


def test_bad_pushes_are_400_and_the_old_weights_keep_serving(
    server: ServerProcess, pusher: WeightPusher, model_dir: Path
) -> None:
    before = pusher.post("/weights_checker", {"action": "checksum"})["checksum"]
    served = engine_greedy(server)["output_ids"]
    pusher.pause("retract")
    try:
        wrong_shape = {"lm_head.weight": torch.zeros(3, 3)}
        unknown_name = {"model.no_such.weight": torch.zeros(4)}
        wrong_dtype = {"lm_head.weight": torch.zeros(server_vocab(server), 64, dtype=torch.int32)}
        bad_pushes = [
            (pusher.push_tensors, wrong_shape, "shape"),
            (pusher.broadcast, unknown_name, "no_such"),
            (pusher.broadcast, wrong_dtype, "dtype"),
            (pusher.push_nixl, wrong_shape, "shape"),
            (pusher.push_nixl, unknown_name, "no_such"),
        ]
        for push, tensors, named in bad_pushes:
            with pytest.raises(EngineRefused) as bad:
                push(tensors)
            assert bad.value.status_code == 400 and named in str(bad.value.body)
        pickled = base64.b64encode(pickle.dumps([("lm_head.weight", torch.zeros(1))])).decode()
        refused = httpx.post(
            f"{server.base_url}/update_weights_from_tensor",
            json={"serialized_named_tensors": [pickled]},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        assert refused.status_code == 400
        assert "--trust-weight-payloads" in refused.json()["error"]["message"]
    finally:
        pusher.resume()
    assert pusher.post("/weights_checker", {"action": "checksum"})["checksum"] == before
    assert engine_greedy(server)["output_ids"] == served


def server_vocab(server: ServerProcess) -> int:
    facts = httpx.post(
        f"{server.base_url}/engine/get_weights_by_name",
        json={"name": "lm_head.weight", "truncate_size": 1},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ).json()
    return int(facts["shape"][0])


def test_update_while_serving_is_409(server: ServerProcess, pusher: WeightPusher) -> None:
    # SGLang's tensor push needs no pause (tests/e2e/test_rl_verl.py); a NIXL pull does.
    with pytest.raises(EngineRefused) as refused:
        pusher.push_nixl({"lm_head.weight": torch.zeros(1)})
    assert refused.value.status_code == 409
    assert "pause" in refused.value.body["error"]["message"]


def test_nixl_descriptors_outside_the_trainers_memory_are_400(
    server: ServerProcess, pusher: WeightPusher
) -> None:
    vocab = server_vocab(server)
    before = pusher.post("/weights_checker", {"action": "checksum"})["checksum"]
    unregistered = {"lm_head.weight": torch.ones(vocab, 64)}
    agent = NixlAgent("test")
    garbled = nixl_pull_body("nobody", b"not metadata", unregistered)
    outside = nixl_pull_body(agent.name, agent.metadata(), unregistered)
    pusher.pause("retract")
    try:
        for body, named in ((garbled, "agent_metadata"), (outside, "registered")):
            with pytest.raises(EngineRefused) as refused:
                pusher.post("/engine/update/update_weights_from_nixl", body)
            assert refused.value.status_code == 400
            assert named in refused.value.body["error"]["message"]
        capabilities = httpx.get(
            f"{server.base_url}/engine/capabilities",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        ).json()
        assert "update_weights_from_nixl" in capabilities["weight_sync"]["methods"]
    finally:
        pusher.resume()
    assert pusher.post("/weights_checker", {"action": "checksum"})["checksum"] == before


def test_a_trainer_that_never_joins_fails_the_init_in_time(server: ServerProcess) -> None:
    client = WeightPusher(server.base_url, admin_key=ADMIN_KEY, timeout_s=30)
    try:
        started = time.monotonic()
        with pytest.raises(EngineRefused) as failed:
            client.post(
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": free_port(),
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "nobody",
                    "backend": "gloo",
                },
            )
        assert failed.value.status_code in (400, 409)
        assert time.monotonic() - started < ADMIN_TIMEOUT_S + 2
    finally:
        client.close()
    assert engine_greedy(server)["meta_info"]["completion_tokens"] == GREEDY_TOKENS
