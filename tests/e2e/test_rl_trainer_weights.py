"""Weight syncs and logprobs of the trainers' own calls, where the engine must really act:
a real ``penstock serve --engine transformers`` on the tiny Llama, and this process as
the trainer (torch, a gloo group, a second checkpoint with other weights).

SkyRL's broadcast (``/init_weight_transfer_engine``, then ``/collective_rpc`` with
``update_weights_nccl`` buckets, packed as vLLM packs them), vLLM's packed broadcast cut
into many buffers of mixed dtypes (a second handshake, then TRL's async GRPO calls) and
AReaL's (``/areal_init_weights_update_group`` with the port in digits,
``/areal_set_update_weight_meta``, ``/areal_update_weights_xccl``) each change the
served weights: afterwards the greedy tokens of ``/inference/v1/generate`` are the
trainer's own, and its logprobs are the trainer's ``log_softmax``. AReaL's LoRA
broadcast (``/areal_set_update_weight_meta_lora``, ``/areal_update_weights_lora_xccl``)
serves the trainer's adapter: its greedy tokens are peft's own.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from peft import PeftModel
from transformers import LlamaForCausalLM

from penstock.engines.weights.sync import (
    destroy_process_group,
    dtype_name,
    init_custom_process_group,
)
from tests.engines.transformers.conftest import peft_greedy, save_tiny_lora
from tests.support.server import ServerProcess, free_port, transformers_server
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "weights-admin-key"
PROMPT = [5, 17, 29, 41]
TOKENS = 6
VLLM_GROUP = "vllm_weight_transfer"
XCCL_LORA = "/areal_update_weights_lora_xccl"
# vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES, and a buffer small enough to cut the tiny Llama
# (about 0.5 MB) into many broadcasts.
PACKED_DEFAULT_BYTES = 1024 * 1024 * 1024
PACKED_SMALL_BYTES = 48 * 1024
MIXED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    with transformers_server(
        model_dir,
        tmp_path_factory.mktemp("serve"),
        "--admin-api-key",
        ADMIN_KEY,
        "--admin-timeout-s",
        "20",
    ) as process:
        yield process


@pytest.fixture(scope="module")
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        yield http


def trained(tmp_path: Path, model_dir: Path, seed: int) -> LlamaForCausalLM:
    """The trainer's model: the same architecture, other weights."""
    folder = build_tiny_llama(tmp_path / f"trained-{seed}", seed=seed, tokenizer_from=model_dir)
    return LlamaForCausalLM.from_pretrained(folder).eval()


def trainer_rollout(model: LlamaForCausalLM) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's ``log_softmax`` under the trainer's own forward pass."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False
        )
        tokens = [int(t) for t in out[0, len(PROMPT) :]]
        logits = model(out).logits[0, len(PROMPT) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
    return tokens, [float(logprobs[i, token]) for i, token in enumerate(tokens)]


def engine_rollout(admin: httpx.Client) -> tuple[list[int], list[float]]:
    # SkyRL's ``_generate_single``: token ids in, token ids and logprobs out.
    body = {
        "sampling_params": {
            "max_tokens": TOKENS,
            "min_tokens": TOKENS,
            "temperature": 0.0,
            "logprobs": 0,
        },
        "model": admin.get("/v1/models").json()["data"][0]["id"],
        "token_ids": PROMPT,
    }
    response = admin.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], [item["logprob"] for item in choice["logprobs"]["content"]]


def with_rank_zero(
    port: int, group_name: str, call: Callable[[], httpx.Response]
) -> tuple[Any, httpx.Response]:
    """Host the trainer's rank 0 of a two-rank gloo group while ``call`` asks the engine
    to join it."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(call)
        group = init_custom_process_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name=group_name,
            timeout_s=20,
        )
        return group, joined.result()


def join_areal_group(admin: httpx.Client, group_name: str) -> Any:
    """AReaL's ``/areal_init_weights_update_group``: the engine joins the trainer's gloo
    group as rank 1; the trainer's end of the group."""
    port = free_port()
    init = {
        "master_address": "127.0.0.1",
        "master_port": str(port),
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
        "group_name": group_name,
    }
    group, joined = with_rank_zero(
        port, group_name, lambda: admin.post("/areal_init_weights_update_group", json=init)
    )
    assert joined.status_code == 200, joined.text
    return group


def broadcast_while(
    group: Any, tensors: list[torch.Tensor], call: Callable[[], httpx.Response]
) -> httpx.Response:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answered = pool.submit(call)
        for tensor in tensors:
            dist.broadcast(tensor, src=0, group=group)
        return answered.result()


def packed_chunks(
    items: list[tuple[str, torch.Tensor]], buffer_bytes: int
) -> list[list[torch.Tensor]]:
    """The tensors of each buffer vLLM's ``trainer_send_weights(packed=True)`` sends: in
    order, a buffer sent once its byte total exceeds ``buffer_bytes``."""
    chunks: list[list[torch.Tensor]] = [[]]
    for _, tensor in items:
        chunks[-1].append(tensor)
        if sum(t.numel() * t.element_size() for t in chunks[-1]) > buffer_bytes:
            chunks.append([])
    return [chunk for chunk in chunks if chunk]


def packed_buffers(items: list[tuple[str, torch.Tensor]], buffer_bytes: int) -> list[torch.Tensor]:
    """Each buffer as broadcast: its tensors' bytes as uint8, concatenated, dtypes mixed."""
    return [
        torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in chunk])
        for chunk in packed_chunks(items, buffer_bytes)
    ]


def assert_serves(admin: httpx.Client, model: LlamaForCausalLM) -> None:
    tokens, logprobs = engine_rollout(admin)
    expected_tokens, expected_logprobs = trainer_rollout(model)
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_skyrl_broadcast_changes_the_served_weights(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    model = trained(tmp_path, model_dir, seed=3)
    assert engine_rollout(admin)[0] != trainer_rollout(model)[0]
    assert admin.get("/get_world_size").json()["world_size"] == 1
    port = free_port()
    # ``BroadcastInitInfo.to_api_payload`` for the one server: the trainer is rank 0.
    init_info = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
    }
    group, joined = with_rank_zero(
        port,
        VLLM_GROUP,
        lambda: admin.post("/init_weight_transfer_engine", json={"init_info": init_info}),
    )
    assert joined.status_code == 200, joined.text
    try:
        assert (
            admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
        )
        rpc = {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": True}}
        assert admin.post("/collective_rpc", json=rpc).status_code == 200
        items = [(name, t.detach().contiguous()) for name, t in model.state_dict().items()]
        update_info = {
            "names": [name for name, _ in items],
            "dtype_names": [dtype_name(t.dtype) for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "packed": True,
        }
        bucket = {"method": "update_weights_nccl", "kwargs": {"update_info": update_info}}
        buffers = packed_buffers(items, PACKED_DEFAULT_BYTES)
        answer = broadcast_while(group, buffers, lambda: admin.post("/collective_rpc", json=bucket))
        assert answer.status_code == 200, answer.text
        finish = admin.post("/collective_rpc", json={"method": "skyrl_finish_weight_update"})
        assert finish.status_code == 200
    finally:
        assert admin.post("/resume").status_code == 200
        destroy_process_group(group)
    assert_serves(admin, model)


def test_vllm_packed_broadcast_spans_buffers_of_mixed_dtypes(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    model = trained(tmp_path, model_dir, seed=8)
    items = []
    with torch.no_grad():
        for index, (name, tensor) in enumerate(model.state_dict().items()):
            sent = tensor.detach().to(MIXED_DTYPES[index % len(MIXED_DTYPES)]).contiguous()
            # The trainer's model holds what it sends: the engine casts back to float32.
            tensor.copy_(sent.float())
            items.append((name, sent))
    buffers = packed_buffers(items, PACKED_SMALL_BYTES)
    assert len(buffers) >= 3
    chunks = packed_chunks(items, PACKED_SMALL_BYTES)
    assert any(len({t.dtype for t in chunk}) > 1 for chunk in chunks)
    port = free_port()
    # ``NCCLTrainerInitInfo`` as vLLM's trainer ships it; TRL's async GRPO flow after it.
    init_info = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
        "packed_buffer_size_bytes": PACKED_SMALL_BYTES,
        "packed_num_buffers": 2,
    }
    group, joined = with_rank_zero(
        port,
        VLLM_GROUP,
        lambda: admin.post("/init_weight_transfer_engine", json={"init_info": init_info}),
    )
    assert joined.status_code == 200, joined.text
    try:
        assert admin.post("/pause", params={"mode": "keep"}).status_code == 200
        started = admin.post("/start_weight_update", json={"is_checkpoint_format": True})
        assert started.status_code == 200, started.text
        update_info = {
            "names": [name for name, _ in items],
            "dtype_names": [dtype_name(t.dtype) for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "packed": True,
        }
        answer = broadcast_while(
            group, buffers, lambda: admin.post("/update_weights", json={"update_info": update_info})
        )
        assert answer.status_code == 200, answer.text
        assert admin.post("/finish_weight_update").status_code == 200
    finally:
        assert admin.post("/resume").status_code == 200
        destroy_process_group(group)
    assert_serves(admin, model)


def test_areal_broadcast_changes_the_served_weights(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    model = trained(tmp_path, model_dir, seed=4)
    group_name = "areal_group"
    group = join_areal_group(admin, group_name)
    try:
        assert admin.post("/areal_pause_generation", json={}).json()["success"] is True
        items = [(name, t.detach().contiguous()) for name, t in model.state_dict().items()]
        meta = {
            "names": [name for name, _ in items],
            "dtypes": [dtype_name(t.dtype) for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "group_name": group_name,
        }
        assert admin.post("/areal_set_update_weight_meta", json=meta).status_code == 200
        answer = broadcast_while(
            group, [t for _, t in items], lambda: admin.post("/areal_update_weights_xccl", json={})
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["success"] is True
    finally:
        assert admin.post("/areal_continue_generation", json={}).status_code == 200
        destroy_process_group(group)
    assert_serves(admin, model)


def test_slime_profile_records_the_engines_forward_passes(
    admin: httpx.Client, tmp_path: Path
) -> None:
    # slime's ``start_profile`` body with its defaults, one rollout, ``stop_profile``.
    body = {
        "output_dir": str(tmp_path),
        "start_step": None,
        "num_steps": None,
        "activities": None,
        "profile_by_stage": False,
        "with_stack": None,
        "record_shapes": None,
    }
    assert admin.post("/start_profile", json=body).status_code == 200
    engine_rollout(admin)
    assert admin.post("/stop_profile", json={}).status_code == 200
    (trace,) = tmp_path.glob("*.trace.json")
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    # The engine's matmuls run on its own thread: they are in the trace.
    assert names & {"aten::linear", "aten::mm", "aten::matmul", "aten::addmm"}


def areal_lora_meta(
    model: Any, group_name: str, version: int, base: str, **fields: Any
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``build_distributed_weight_update_requests`` with ``use_lora``: the trainable
    parameters of the trainer's peft model, named as it names them."""
    items = [(n, p.detach().contiguous()) for n, p in model.named_parameters() if p.requires_grad]
    meta = {
        "names": [name for name, _ in items],
        "dtypes": [dtype_name(t.dtype) for _, t in items],
        "shapes": [list(t.shape) for _, t in items],
        "group_name": group_name,
        "lora_name": f"policy-v{version}",
        "lora_int_id": 1,
        "lora_target_modules": ["q_proj", "v_proj"],
        "lora_rank": 4,
        "lora_alpha": 8,
        "lora_bias": "none",
        "base_model_name": base,
        **fields,
    }
    return meta, [t for _, t in items]


def lora_greedy(admin: httpx.Client, name: str) -> list[int]:
    body = {"model": name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    answer = admin.post("/v1/completions", json={**body, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


def test_areal_lora_broadcast_serves_the_adapter(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    base = admin.get("/v1/models").json()["data"][0]["id"]
    # The adapters are trained on the checkpoint's weights, which earlier syncs replaced.
    assert admin.post("/areal_pause_generation", json={}).status_code == 200
    assert admin.post("/areal_update_weights", json={"model_path": str(model_dir)}).is_success
    assert admin.post("/areal_continue_generation", json={}).status_code == 200
    group_name = "areal_lora_group"
    group = join_areal_group(admin, group_name)
    try:
        for version in range(2):
            folder = save_tiny_lora(model_dir, tmp_path / f"step-{version}", seed=60 + version)
            trainer = PeftModel.from_pretrained(
                LlamaForCausalLM.from_pretrained(model_dir), str(folder), is_trainable=True
            )
            meta, tensors = areal_lora_meta(trainer, group_name, version, base)
            assert admin.post("/areal_set_update_weight_meta_lora", json=meta).status_code == 200
            answer = broadcast_while(group, tensors, partial(admin.post, XCCL_LORA, json=meta))
            assert answer.status_code == 200, answer.text
            assert answer.json()["success"] is True
            assert lora_greedy(admin, f"policy-v{version}") == peft_greedy(
                model_dir, folder, PROMPT, 4
            )
        served = {model["id"] for model in admin.get("/v1/models").json()["data"]}
        assert "policy-v1" in served and "policy-v0" not in served
        # Matrices that fit no module of the model: received whole, then refused at the
        # load, and the adapter served before stays.
        before = lora_greedy(admin, "policy-v1")
        meta, tensors = areal_lora_meta(trainer, group_name, 1, base)
        tensors = [t.t().contiguous() for t in tensors]
        meta["shapes"] = [list(t.shape) for t in tensors]
        assert admin.post("/areal_set_update_weight_meta_lora", json=meta).status_code == 200
        refused = broadcast_while(group, tensors, partial(admin.post, XCCL_LORA, json=meta))
        assert refused.status_code == 400 and "does not fit" in refused.text
        assert lora_greedy(admin, "policy-v1") == before
        # One matrix under two spellings: the engine refuses it, still receiving the
        # broadcast.
        first = meta["names"][0]
        twice = {**meta, "names": [first, first.replace(".default", ""), *meta["names"][2:]]}
        assert admin.post("/areal_set_update_weight_meta_lora", json=twice).status_code == 200
        refused = broadcast_while(group, tensors, partial(admin.post, XCCL_LORA, json=twice))
        assert refused.status_code == 400 and "twice" in refused.text
        assert lora_greedy(admin, "policy-v1") == before
        other = {**meta, "names": ["model.layers.0.mlp.weight", *meta["names"][1:]]}
        named = admin.post("/areal_set_update_weight_meta_lora", json=other)
        assert named.status_code == 400 and named.json()["error"]["param"] == "names[0]"
        bias = admin.post("/areal_set_update_weight_meta_lora", json={**meta, "lora_bias": "all"})
        assert bias.status_code == 400 and bias.json()["error"]["param"] == "lora_bias"
    finally:
        destroy_process_group(group)
