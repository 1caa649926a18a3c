"""verl's SGLang HTTP adapter (``AsyncHttpServerAdapter`` in
``verl/workers/rollout/sglang_rollout/http_server_engine.py``, driven by its
``ServerAdapter``) against a real ``penstock serve --engine transformers
--trust-weight-payloads`` on the tiny Llama, configured as ``docs/rl-trainers.md``'s verl
quick-start says: no admin key, the trainer on the same host (the adapter sends no
``Authorization`` header).

verl pushes its weights with ``/update_weights_from_tensor`` without pausing: on an awake
engine while rollouts stream, and after ``release_memory_occupation`` then
``resume_memory_occupation {tags: ["weights"]}`` (the KV cache still released). Both
land: afterwards the engine's greedy tokens are the trainer's, ``/health`` says how the
last update was applied, and every stream that ran through the push ends whole.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from transformers import LlamaForCausalLM

from tests.support.cuda_payloads import LOCAL_SERIALIZED_TENSOR_MODULE, fake_module
from tests.support.server import ServerProcess, transformers_server
from tests.support.tiny_llm import build_tiny_llama

PROMPT = [5, 17, 29, 41]
GREEDY_TOKENS = 8
STREAMS = 3
STREAM_TOKENS = 500


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    with transformers_server(
        model_dir,
        tmp_path_factory.mktemp("serve"),
        "--trust-weight-payloads",
        "--admin-timeout-s",
        "30",
        engine_args=("--max-num-seqs", "8"),
    ) as process:
        yield process


@pytest.fixture(scope="module")
def verl(server: ServerProcess) -> Iterator[httpx.Client]:
    """The adapter's client: plain requests to ``http://host:port/<endpoint>``."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        yield http


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def trained(tmp_path: Path, model_dir: Path, seed: int) -> LlamaForCausalLM:
    folder = build_tiny_llama(tmp_path / f"trained-{seed}", seed=seed, tokenizer_from=model_dir)
    return LlamaForCausalLM.from_pretrained(folder).eval()


def trainer_greedy(model: LlamaForCausalLM) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=GREEDY_TOKENS,
            min_new_tokens=GREEDY_TOKENS,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(PROMPT) :]]


def engine_greedy(verl: httpx.Client) -> list[int]:
    # ``AsyncHttpServerAdapter.generate`` with the None fields dropped.
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": GREEDY_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }
    return list(ok(verl.post("/generate", json=body))["output_ids"])


def weight_buckets(model: LlamaForCausalLM, count: int) -> list[dict[str, torch.Tensor]]:
    """``get_named_tensor_buckets``: the trainer's tensors in ``count`` buckets."""
    items = [(name, t.detach().contiguous()) for name, t in model.state_dict().items()]
    size = -(-len(items) // count)
    return [dict(items[i : i + size]) for i in range(0, len(items), size)]


def tensor_push_body(bucket: dict[str, torch.Tensor]) -> dict[str, Any]:
    """SGLang's ``update_weights`` (``sglang.srt.weight_sync.utils``) for one engine rank:
    ``[(name, LocalSerializedTensor(values=[serialized tensor]))]`` serialized by
    ``MultiprocessingSerializer``, then as the adapter posts it (base64, ``load_format``
    None, ``flush_cache`` False). CPU tensors travel by shared-memory file name."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        with fake_module(LOCAL_SERIALIZED_TENSOR_MODULE) as module:
            local_serialized = type("LocalSerializedTensor", (), {"__module__": module.__name__})
            module.LocalSerializedTensor = local_serialized  # type: ignore[attr-defined]
            entries = []
            for name, tensor in bucket.items():
                entry = local_serialized()
                entry.values = [bytes(ForkingPickler.dumps(tensor))]
                entries.append((name, entry))
            raw = bytes(ForkingPickler.dumps(entries))
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return {
        "serialized_named_tensors": [base64.b64encode(raw).decode()],
        "load_format": None,
        "flush_cache": False,
    }


def push(verl: httpx.Client, model: LlamaForCausalLM) -> None:
    """``ServerAdapter.update_weights``: every bucket, then the adapter's ``flush_cache``."""
    post_buckets(verl, [tensor_push_body(bucket) for bucket in weight_buckets(model, 2)])


def post_buckets(verl: httpx.Client, bodies: list[dict[str, Any]]) -> None:
    for body in bodies:
        assert ok(verl.post("/update_weights_from_tensor", json=body))["success"]
    assert verl.get("/flush_cache").status_code == 200


def last_update(verl: httpx.Client) -> dict[str, Any]:
    update: dict[str, Any] = verl.get("/health").json()["admin"]["last_update"]
    return update


async def stream(
    base_url: str, index: int, started: asyncio.Event | None = None
) -> list[dict[str, Any]]:
    """The events of one streamed rollout; ``started`` is set at the first."""
    events = []
    body = {
        "input_ids": [3 + index, 7, 11],
        "sampling_params": {"max_new_tokens": STREAM_TOKENS, "ignore_eos": True},
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        async with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(orjson.loads(line.removeprefix("data: ")))
                    if started is not None:
                        started.set()
    return events


async def test_verl_pushes_into_an_awake_engine_while_rollouts_stream(
    server: ServerProcess, verl: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    model = trained(tmp_path, model_dir, seed=5)
    assert engine_greedy(verl) != trainer_greedy(model)
    # Serialized first, as the trainer has its buckets before it syncs.
    bodies = [tensor_push_body(bucket) for bucket in weight_buckets(model, 2)]
    started = [asyncio.Event() for _ in range(STREAMS)]
    rollouts = [asyncio.create_task(stream(server.base_url, i, started[i])) for i in range(STREAMS)]
    # Every rollout under way, none finished: then verl's sync, without a pause.
    await asyncio.gather(*(event.wait() for event in started))
    assert not any(rollout.done() for rollout in rollouts)
    await asyncio.to_thread(post_buckets, verl, bodies)
    assert last_update(verl)["applied"] == "between_steps"
    for events in await asyncio.gather(*rollouts):
        finals = [e for e in events if e["meta_info"]["finish_reason"] is not None]
        assert len(finals) == 1 and events[-1] is finals[0]
        assert len(finals[0]["output_ids"]) == STREAM_TOKENS
    assert engine_greedy(verl) == trainer_greedy(model)
    assert last_update(verl)["method"] == "update_weights_from_tensor"


def test_verl_pushes_while_the_kv_cache_is_released(
    verl: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    model = trained(tmp_path, model_dir, seed=6)
    assert engine_greedy(verl) != trainer_greedy(model)
    # ``ServerAdapter.release``, then ``resume(tags=["weights"])`` before the sync.
    ok(verl.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}))
    ok(verl.post("/resume_memory_occupation", json={"tags": ["weights"]}))
    push(verl, model)
    assert last_update(verl)["applied"] == "kv_released"
    ok(verl.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}))
    assert engine_greedy(verl) == trainer_greedy(model)


def test_verl_refuses_a_push_into_released_weights(
    verl: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    model = trained(tmp_path, model_dir, seed=7)
    ok(verl.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}))
    try:
        (bucket, *_) = weight_buckets(model, 2)
        refused = verl.post("/update_weights_from_tensor", json=tensor_push_body(bucket))
        assert refused.status_code == 409
        assert "sleeping" in refused.json()["error"]["message"]
    finally:
        ok(verl.post("/resume_memory_occupation", json={"tags": None}))
    assert engine_greedy(verl) != trainer_greedy(model)


def test_verl_default_abort_is_a_no_op(verl: httpx.Client) -> None:
    # ``abort_request()`` with its defaults.
    answer = ok(verl.post("/abort_request", json={"rid": "", "abort_all": False}))
    assert answer["aborted"] == []
    assert len(engine_greedy(verl)) == GREEDY_TOKENS


def test_get_weights_by_name_answers_sglangs_bare_list(verl: httpx.Client) -> None:
    asked = {"name": "lm_head.weight", "truncate_size": 2}
    rows = ok(verl.post("/get_weights_by_name", json=asked))
    described = ok(verl.post("/engine/get_weights_by_name", json={"name": "lm_head.weight"}))
    assert len(rows) == 2 and len(rows[0]) == described["shape"][1]
    assert rows == [pytest.approx(row) for row in described["values"][:2]]
