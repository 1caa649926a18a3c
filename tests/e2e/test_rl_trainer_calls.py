"""Each RL framework's calls to its inference server, with the bodies its client code
sends (recorded from the frameworks' sources, listed in ``docs/rl-trainers.md``), against
a real ``penstock serve`` (sample engine); each test checks what that client reads back.

The sample engine's "weights" are one shift of its token rotation: a disk update with
shift ``s`` moves every output token ``s`` places, which tells a real update from none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from penstock.engines.samples.engine import write_sample_weights
from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
ADMIN_KEY = "trainer-calls-admin-key"
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--engine", "sample", "--admin-api-key", ADMIN_KEY]
    with running_server(args, tmp_path_factory.mktemp("calls")) as running:
        yield running


@pytest.fixture(scope="module")
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        yield http


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def generated(client: httpx.Client, count: int = 4) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": count}}
    return list(ok(client.post("/generate", json=body))["output_ids"])


def weights(tmp_path: Path, name: str, shift: int) -> str:
    folder = tmp_path / name
    folder.mkdir()
    write_sample_weights(folder, shift)
    return str(folder)


# -- slime ---------------------------------------------------------------------------


def test_slime_reads_the_server_args_it_compares(admin: httpx.Client) -> None:
    # ``get_server_info`` tries /server_info, then /get_server_info; ``_init_external``
    # compares each argument it would have launched the engine with.
    for path in ("/server_info", "/get_server_info"):
        info = ok(admin.get(path))
        assert info["enable_memory_saver"] is False
        for name in ("tp_size", "pp_size", "ep_size", "dp_size", "moe_dp_size"):
            assert info[name] == 1
        assert info["disaggregation_mode"] == "null" and info["encoder_only"] is False


def test_slime_counts_requests_with_v1_loads(admin: httpx.Client) -> None:
    load = ok(admin.get("/v1/loads", params={"include": "core"}))
    (rank,) = load["loads"]
    assert rank["num_reqs"] == rank["num_running_reqs"] + rank["num_waiting_reqs"] == 0


def test_slime_weight_step_from_disk(admin: httpx.Client, tmp_path: Path) -> None:
    before = generated(admin)
    ok(admin.post("/pause_generation", json={}))
    update = {"model_path": weights(tmp_path, "slime", 2), "weight_version": "slime-1"}
    ok(admin.post("/update_weights_from_disk", json=update))
    ok(admin.post("/continue_generation", json={}))
    assert ok(admin.get("/get_weight_version"))["weight_version"] == "slime-1"
    assert generated(admin) != before
    assert ok(admin.post("/abort_request", json={"abort_all": True}))["status"] == "ok"
    # slime retries until a 200; it reads nothing else.
    assert admin.get("/flush_cache").status_code == 200
    assert ok(admin.get("/health_generate"))["status"] == "ok"


def test_slime_post_process_hooks_and_delta_pull(admin: httpx.Client, tmp_path: Path) -> None:
    # ``post_process_weights``: both hooks off asks for nothing; each on is refused.
    hooks = {"restore_weights_before_load": False, "post_process_quantization": False}
    assert ok(admin.post("/post_process_weights", json=hooks))["success"] is True
    for field in hooks:
        refused = admin.post("/post_process_weights", json={**hooks, field: True})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == field
    # The sample engine serves no checkpoint folder for deltas to start from (the pulls
    # themselves are in test_rl_weight_deltas.py); nothing is written.
    pull = {
        "local_checkpoint_dir": str(tmp_path / "ckpt"),
        "source_dir": str(tmp_path / "unpublished"),
        "target_version": 3,
    }
    refused = admin.post("/pull_weights", json=pull)
    assert refused.status_code == 400
    assert "checkpoint folder" in refused.json()["error"]["message"]
    assert not (tmp_path / "ckpt").exists()
    remote = admin.post("/pull_weights", json={**pull, "source_dir": "s3://bucket/pub"})
    assert remote.status_code == 400 and remote.json()["error"]["param"] == "source_dir"
    assert len(generated(admin)) == 4


def test_slime_profiles_the_server_to_a_folder(admin: httpx.Client, tmp_path: Path) -> None:
    # ``start_profile``'s body with slime's defaults; it reads the status only.
    body: dict[str, Any] = {
        "output_dir": str(tmp_path / "profile"),
        "start_step": None,
        "num_steps": None,
        "activities": ["CPU"],
        "profile_by_stage": False,
        "with_stack": None,
        "record_shapes": None,
    }
    assert admin.post("/start_profile", json=body).status_code == 200
    assert admin.post("/start_profile", json=body).status_code == 409
    assert len(generated(admin)) == 4
    stopped = admin.post("/stop_profile", json={})
    assert stopped.status_code == 200, stopped.text
    (trace,) = (tmp_path / "profile").iterdir()
    assert trace.name in stopped.text
    assert "traceEvents" in json.loads(trace.read_text())
    assert admin.post("/stop_profile", json={}).status_code == 409
    for field, value in (("num_steps", 5), ("activities", ["GPU"]), ("profile_by_stage", True)):
        refused = admin.post("/start_profile", json={**body, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    missing = admin.post("/start_profile", json={**body, "output_dir": None})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "output_dir"


# -- SkyRL ---------------------------------------------------------------------------


def test_skyrl_sizes_its_group_and_generates_tokens(admin: httpx.Client) -> None:
    assert ok(admin.get("/get_world_size"))["world_size"] == 1
    body = {
        "sampling_params": {"max_tokens": 4, "temperature": 1.0, "logprobs": 0},
        "model": MODEL,
        "token_ids": PROMPT,
    }
    choice = ok(admin.post("/inference/v1/generate", json=body))["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
    logprobs = [item["logprob"] for item in choice["logprobs"]["content"]]
    assert len(logprobs) == 4 and all(value <= 0.0 for value in logprobs)


def test_skyrl_sleeps_and_wakes_around_a_weight_sync(admin: httpx.Client) -> None:
    ok(admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}))
    rpc = {"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": True}}
    assert ok(admin.post("/collective_rpc", json=rpc)) == {"results": [None]}
    assert ok(admin.get("/is_sleeping"))["is_sleeping"] is True
    for tags in (["weights"], ["kv_cache"]):
        wake = {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": tags}}
        ok(admin.post("/collective_rpc", json=wake))
    assert ok(admin.get("/is_sleeping"))["is_sleeping"] is False
    ok(admin.post("/collective_rpc", json={"method": "skyrl_start_weight_update"}))
    ok(admin.post("/collective_rpc", json={"method": "skyrl_finish_weight_update"}))
    ok(admin.post("/resume"))
    assert len(generated(admin)) == 4
    ok(admin.post("/reset_prefix_cache", json={"reset_running_requests": False}))


def test_skyrl_cuda_ipc_is_refused_by_name(admin: httpx.Client) -> None:
    rpc = {"method": "update_weights_ipc", "kwargs": {"update_info": {"names": ["w"]}}}
    response = admin.post("/collective_rpc", json=rpc)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "transport_unavailable"
    assert "CUDA IPC" in response.json()["error"]["message"]
    unknown = admin.post("/collective_rpc", json={"method": "reload_everything"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "method"


def test_vllm_dev_routes_trainers_call(admin: httpx.Client, tmp_path: Path) -> None:
    # ``vllm serve`` with VLLM_SERVER_DEV_MODE=1: vLLM's own worker methods over
    # ``/collective_rpc``, its caches and its KV release.
    health = {"method": "check_health", "args": [], "kwargs": {}}
    assert ok(admin.post("/collective_rpc", json=health)) == {"results": [None]}
    before = generated(admin)
    reload = {"method": "reload_weights", "kwargs": {"weights_path": weights(tmp_path, "r", 3)}}
    assert ok(admin.post("/collective_rpc", json=reload)) == {"results": [None]}
    after = generated(admin)
    assert after != before and ok(admin.get("/health"))["admin"]["state"] == "serving"
    assert admin.post("/reset_mm_cache").status_code == 200
    refused = admin.post("/release_kv_cache_memory")
    assert refused.status_code == 409 and "pause" in refused.json()["error"]["message"]
    ok(admin.post("/pause", params={"mode": "keep"}))
    assert ok(admin.post("/release_kv_cache_memory")) == {"status": "kv_cache_released"}
    assert ok(admin.get("/is_sleeping"))["is_sleeping"] is True
    ok(admin.post("/wake_up", params={"tags": "kv_cache"}))
    ok(admin.post("/resume"))
    assert generated(admin) == after
    ok(
        admin.post(
            "/collective_rpc",
            json={**reload, "kwargs": {"weights_path": weights(tmp_path, "s", 0)}},
        )
    )


def test_skyrl_tokenizes_one_text_at_a_time(admin: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "hello", "add_special_tokens": True}
    tokens = ok(admin.post("/tokenize", json=body))["tokens"]
    text = ok(admin.post("/detokenize", json={"model": MODEL, "tokens": tokens}))["prompt"]
    assert text == "hello"


def test_skyrl_routed_experts_refused_and_delta_fetch_needs_its_init(
    admin: httpx.Client,
) -> None:
    body = {"sampling_params": {"max_tokens": 4}, "model": MODEL, "token_ids": PROMPT}
    routed = admin.post("/skyrl/v1/generate", json=body)
    assert routed.status_code == 400
    assert routed.json()["error"]["param"] == "routed_experts"
    # Before a delta ``/init_weight_transfer_engine`` there is no local checkpoint to
    # patch (the fetch itself is in test_rl_weight_deltas.py).
    fetch = {"target_version": 2, "sync_dir": "/tmp/sync"}
    refused = admin.post("/fetch_weights", json=fetch)
    assert refused.status_code == 409
    assert "/init_weight_transfer_engine" in refused.json()["error"]["message"]
    bad = admin.post("/fetch_weights", json={"sync_dir": "/tmp/sync"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "target_version"


def test_vllm_tokens_generate_streams_new_tokens(admin: httpx.Client) -> None:
    params = {"max_tokens": 5, "temperature": 0, "logprobs": 0}
    body = {"sampling_params": params, "model": MODEL, "token_ids": PROMPT}
    whole = ok(admin.post("/inference/v1/generate", json=body))["choices"][0]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with admin.stream("POST", "/inference/v1/generate", json=streamed) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert len({event["request_id"] for event in events}) == 1
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    tokens = [t for event in chunks for t in event["choices"][0]["token_ids"]]
    logprobs = [
        item["logprob"] for event in chunks for item in event["choices"][0]["logprobs"]["content"]
    ]
    assert tokens == whole["token_ids"]
    assert logprobs == [item["logprob"] for item in whole["logprobs"]["content"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(event["choices"][0]["finish_reason"] is None for event in chunks[:-1])
    not_streamed = admin.post("/inference/v1/generate", json={**streamed, "stream": False})
    assert not_streamed.status_code == 400
    assert not_streamed.json()["error"]["param"] == "stream_options"


# -- prime-rl ------------------------------------------------------------------------


def prime_rl_update(admin: httpx.Client, weight_dir: str) -> None:
    # ``update_weights``: pause keeping in-flight requests, reload, resume.
    ok(admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}))
    try:
        assert ok(admin.post("/update_weights", json={"weight_dir": weight_dir}))["status"] == "ok"
    finally:
        ok(admin.post("/resume"))


def test_prime_rl_filesystem_weight_update(admin: httpx.Client, tmp_path: Path) -> None:
    ok(admin.get("/health"))
    assert MODEL in [model["id"] for model in ok(admin.get("/v1/models"))["data"]]
    ok(admin.get("/liveness"))
    prime_rl_update(admin, weights(tmp_path, "step-0", 0))
    baseline = generated(admin)
    prime_rl_update(admin, weights(tmp_path, "step-1", 3))
    assert generated(admin) != baseline
    prime_rl_update(admin, weights(tmp_path, "step-2", 0))
    assert generated(admin) == baseline


def test_prime_rl_nccl_broadcaster_is_refused(admin: httpx.Client) -> None:
    body = {
        "host": "127.0.0.1",
        "port": 29400,
        "rank_offset": 0,
        "inference_world_size": 1,
        "timeout": 60,
        "quantize_in_weight_transfer": False,
    }
    response = admin.post("/init_broadcaster", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "transport_unavailable"
    assert "NCCL" in response.json()["error"]["message"]
    null_dir = admin.post("/update_weights", json={"weight_dir": None})
    assert null_dir.status_code == 400 and null_dir.json()["error"]["param"] == "weight_dir"


# -- TRL -----------------------------------------------------------------------------


def test_trl_client_generates_with_its_defaults(admin: httpx.Client) -> None:
    assert ok(admin.get("/health/")) == {"status": "ok"}
    assert ok(admin.get("/get_world_size/"))["world_size"] == 1
    # ``VLLMClient.generate``'s body with its defaults, two prompts of ids, n=2.
    body = {
        "prompts": [PROMPT, [9, 10]],
        "images": None,
        "n": 2,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": 3,
        "logprobs": 0,
        "structured_outputs_regex": None,
        "generation_kwargs": {},
    }
    answer = ok(admin.post("/generate/", json=body))
    assert answer["prompt_ids"] == [PROMPT, [9, 10]]
    assert len(answer["completion_ids"]) == 4
    assert all(len(ids) == 3 for ids in answer["completion_ids"])
    for ids, logprobs, logprob_ids in zip(
        answer["completion_ids"], answer["logprobs"], answer["logprob_token_ids"], strict=True
    ):
        assert [pair[0] for pair in logprob_ids] == ids
        assert all(len(values) == 1 and values[0] <= 0.0 for values in logprobs)


def test_trl_top_logprobs_are_ranked_and_hold_the_sampled_token(admin: httpx.Client) -> None:
    body = {"prompts": ["hello"], "max_tokens": 2, "logprobs": 2}
    answer = ok(admin.post("/generate/", json=body))
    for values, ids, sampled in zip(
        answer["logprobs"][0],
        answer["logprob_token_ids"][0],
        answer["completion_ids"][0],
        strict=True,
    ):
        assert values == sorted(values, reverse=True)
        assert sampled in ids and 2 <= len(ids) <= 3


def test_trl_weight_sync_routes(admin: httpx.Client) -> None:
    body = {"host": "0.0.0.0", "port": 51216, "world_size": 2, "client_device_uuid": "42"}
    refused = admin.post("/init_communicator/", json=body)
    assert refused.status_code == 400 and "NCCL" in refused.json()["error"]["message"]
    param = {"name": "model.embed_tokens.weight", "dtype": "torch.float32", "shape": [4, 2]}
    assert admin.post("/update_named_param/", json=param).status_code == 400
    assert "resetting prefix cache" in ok(admin.post("/reset_prefix_cache/"))["message"]
    assert "closing communicator" in ok(admin.post("/close_communicator/", json={}))["message"]


# -- AReaL ---------------------------------------------------------------------------


def test_areal_vllm_completion_names_tokens_by_id(admin: httpx.Client) -> None:
    body = {
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 3,
        "temperature": 1.0,
        "stop_token_ids": [],
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
        "use_beam_search": False,
        "stream": False,
        "model": MODEL,
        "prompt": PROMPT,
    }
    choice = ok(admin.post("/v1/completions", json=body))["choices"][0]
    tokens = [int(token.split(":")[1]) for token in choice["logprobs"]["tokens"]]
    assert len(tokens) == len(choice["logprobs"]["token_logprobs"]) == 3
    assert all(token >= 0 for token in tokens)


def test_areal_sglang_generate_and_disk_update(admin: httpx.Client, tmp_path: Path) -> None:
    body = {
        "input_ids": PROMPT,
        "image_data": None,
        "sampling_params": {
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": 3,
            "temperature": 1.0,
            "stop_token_ids": [],
            "ignore_eos": False,
            "skip_special_tokens": True,
            "frequency_penalty": 0.0,
        },
        "return_logprob": True,
        "stream": False,
    }
    meta = ok(admin.post("/generate", json=body))["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert len(meta["output_token_logprobs"]) == 3
    ok(admin.post("/pause_generation", json={}))
    update = {"model_path": weights(tmp_path, "areal", 0), "abort_all_requests": True}
    ok(admin.post("/update_weights_from_disk", json=update))
    ok(admin.post("/continue_generation", json={}))


def test_areal_vllm_routes_update_from_disk(admin: httpx.Client, tmp_path: Path) -> None:
    assert ok(admin.post("/areal_pause_generation", json={}))["success"] is True
    update = {"model_path": weights(tmp_path, "areal-vllm", 0)}
    assert ok(admin.post("/areal_update_weights", json=update))["success"] is True
    assert ok(admin.post("/areal_continue_generation", json={}))["success"] is True
    assert len(generated(admin)) == 4
    early = admin.post("/areal_update_weights_lora_xccl", json={})
    assert early.status_code == 409
    meta = {
        "names": ["model.layers.0.self_attn.q_proj.lora_A.default.weight"],
        "dtypes": ["float32"],
        "shapes": [[4, 8]],
        "group_name": "areal",
        "lora_name": "policy-v1",
        "lora_int_id": 1,
        "lora_target_modules": ["q_proj"],
        "lora_rank": 4,
        "lora_alpha": 8,
        "lora_bias": "none",
        "base_model_name": MODEL,
    }
    assert ok(admin.post("/areal_set_update_weight_meta_lora", json=meta))["success"] is True
    # The sample engine has no model to receive an adapter for.
    lora = admin.post("/areal_update_weights_lora_xccl", json=meta)
    assert lora.status_code == 400
    assert "receive_lora_adapter" in lora.json()["error"]["message"]


# -- verl ----------------------------------------------------------------------------


def test_verl_http_adapter_calls(admin: httpx.Client) -> None:
    # ``HttpServerAdapter.generate`` drops the None fields before posting.
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 3, "temperature": 1.0},
        "return_logprob": True,
        "top_logprobs_num": 1,
    }
    meta = ok(admin.post("/generate", json=body))["meta_info"]
    assert len(meta["output_top_logprobs"]) == 3
    ok(admin.get("/health"))
    ok(admin.post("/release_memory_occupation", json={"tags": None}))
    ok(admin.post("/resume_memory_occupation", json={"tags": None}))
    assert ok(admin.post("/abort_request", json={"rid": "", "abort_all": True}))["status"] == "ok"
    assert len(generated(admin)) == 4
