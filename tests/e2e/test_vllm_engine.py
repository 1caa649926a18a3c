"""``penstock serve --engine vllm`` on the default model folder: vLLM's ``AsyncLLM`` in the
gateway's process, in vLLM's CPU build (its environment built on first use, with
Penstock's requirements added: ``tests/conformance/vllm_venv.py``).

One engine for the module (vLLM's start takes about 20 s and 5 GiB), started with
``--enable-lora`` (its LoRA layers leave the base model's tokens and logprobs as they
were): it answers the README's question (with vLLM's engine statistics on ``/metrics``),
constrains output through vLLM's guided decoding, pauses and resumes, takes a disk update
that changes its answer and one that brings it back (vLLM's ``collective_rpc
reload_weights``), takes tensor pushes that change it and bring it back (whole-model
reloads through Penstock's worker extension) and refuses a push the model cannot take,
serves a peft LoRA adapter as peft does, says on the CPU that sleep freed nothing,
refuses what vLLM cannot do with a 400 naming why, and its greedy tokens and logprobs are
those of vLLM's own server on the same folder and dtype.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import ensure_default_model
from penstock.engines.weights.sync import encode_safetensors
from tests.conformance.servers import (
    SERVED_MODEL_NAME,
    TOOL_CALL_PARSER,
    start_vllm,
    stop,
    wait_healthy,
)
from tests.conformance.vllm_venv import vllm_penstock_python, vllm_python
from tests.engines.transformers.conftest import peft_greedy, save_tiny_lora
from tests.support.server import REPO_ROOT, ServerProcess, start_server

# The first run builds vLLM's environment (minutes), then both servers start at once.
pytestmark = pytest.mark.timeout(2400)
READY_TIMEOUT_S = 900.0
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# A vLLM server already running the conformance suite's way, used instead of a fresh one.
VLLM_URL_VARIABLE = "PENSTOCK_CONFORMANCE_VLLM_URL"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model(default_model_cache_dir())


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, str]]:
    """(``penstock serve --engine vllm``, the URL of vLLM's own server), both in float32."""
    log_dir = tmp_path_factory.mktemp("vllm-engine")
    python = vllm_penstock_python(REPO_ROOT)
    running_vllm = os.environ.get(VLLM_URL_VARIABLE)
    deadline = time.monotonic() + READY_TIMEOUT_S
    theirs = None if running_vllm else start_vllm(vllm_python(), model_dir, log_dir)
    ours = start_server(
        [
            *("--engine", "vllm", "--served-model-name", SERVED_MODEL_NAME),
            *("--tool-call-parser", TOOL_CALL_PARSER),
            *("--model", str(model_dir), "--dtype", "float32", "--enforce-eager"),
            # vLLM's LoRA layers, built only at start (vLLM's own server runs without them).
            *("--enable-lora", "--max-lora-rank", "8"),
        ],
        log_dir,
        env=VLLM_ENV,
        wait_ready=False,
        python=python,
    )
    try:
        wait_healthy(ours, "penstock serve --engine vllm", deadline)
        if theirs is not None:
            wait_healthy(theirs, "vLLM", deadline)
        yield ours, running_vllm or theirs.base_url  # type: ignore[union-attr]
    finally:
        stop(ours)
        if theirs is not None:
            stop(theirs)


@pytest.fixture(scope="module")
def server(servers: tuple[ServerProcess, str]) -> ServerProcess:
    return servers[0]


def answer(client: httpx.Client, **extra: Any) -> str:
    body = {"model": SERVED_MODEL_NAME, "messages": QUESTION, "max_tokens": 16, "temperature": 0}
    response = client.post("/v1/chat/completions", json={**body, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def admin(client: httpx.Client, route: str, body: dict[str, Any] | None = None) -> dict:
    response = client.post(f"/engine/{route}", json=body or {})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_readme_question_is_answered_streamed_and_counted(client: httpx.Client) -> None:
    assert "Paris" in answer(client)
    body = {"model": SERVED_MODEL_NAME, "messages": QUESTION, "max_tokens": 16, "stream": True}
    body["stream_options"] = {"include_usage": True}
    text, usage = "", None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            usage = chunk.get("usage") or usage
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    assert text and usage["completion_tokens"] > 0
    metrics = client.get("/metrics").text
    # vLLM's engine statistics beside the gateway's own vllm:* families, none twice.
    assert 'vllm:prefix_cache_queries_total{engine="0"' in metrics
    types = [line for line in metrics.splitlines() if line.startswith("# TYPE vllm:")]
    assert len(types) == len(set(types))


def test_structured_outputs_go_through_vllms_guided_decoding(client: httpx.Client) -> None:
    body = {"model": SERVED_MODEL_NAME, "prompt": "Is the sky blue? Answer:", "max_tokens": 5}
    chose = client.post(
        "/v1/completions", json={**body, "structured_outputs": {"choice": ["no", "maybe"]}}
    )
    assert chose.status_code == 200, chose.text
    assert chose.json()["choices"][0]["text"] in ("no", "maybe")
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    called = client.post(
        "/v1/chat/completions",
        json={
            "model": SERVED_MODEL_NAME,
            "messages": QUESTION,
            "max_tokens": 60,
            "temperature": 0,
            "tools": [tool],
            "tool_choice": named,
        },
    )
    assert called.status_code == 200, called.text
    (call,) = called.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert "city" in json.loads(call["function"]["arguments"])


def test_greedy_tokens_and_logprobs_equal_vllms_own_server(
    servers: tuple[ServerProcess, str],
) -> None:
    ours, vllm_url = servers
    bodies = [
        {"prompt": "The capital of France is", "max_tokens": 24, "logprobs": 3},
        {"prompt": "def fibonacci(n):", "max_tokens": 24, "logprobs": 3, "min_tokens": 20},
    ]
    chat = {"messages": QUESTION, "max_tokens": 24, "logprobs": True, "top_logprobs": 3}
    cases = [*(("/v1/completions", body) for body in bodies), ("/v1/chat/completions", chat)]
    for path, body in cases:
        full = {"model": SERVED_MODEL_NAME, "temperature": 0, **body}
        with ThreadPoolExecutor(2) as pool:
            theirs, mine = pool.map(
                lambda url, path=path, full=full: httpx.post(url + path, json=full, timeout=120),
                [vllm_url, ours.base_url],
            )
        assert _greedy(mine.json()) == _greedy(theirs.json()), path


def _greedy(answer: dict) -> tuple:
    """A choice's text, finish reason and logprobs (rounded at float32's noise)."""
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    if "content" in (logprobs or {}):
        values = [
            (
                entry["token"],
                round(entry["logprob"], 4),
                [t["token"] for t in entry["top_logprobs"]],
            )
            for entry in logprobs["content"]
        ]
        text = choice["message"]["content"]
    else:
        values = [
            (token, round(value, 4), sorted(top, key=top.get, reverse=True))
            for token, value, top in zip(
                logprobs["tokens"],
                logprobs["token_logprobs"],
                logprobs["top_logprobs"],
                strict=True,
            )
        ]
        text = choice["text"]
    return text, choice["finish_reason"], values


def test_a_paused_engine_holds_requests_until_resumed(client: httpx.Client) -> None:
    assert admin(client, "pause_generation", {"mode": "keep"})["state"] == "paused"
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(answer, client)
        time.sleep(1.0)
        assert not held.done()
        assert admin(client, "resume_generation")["state"] == "serving"
        assert "Paris" in held.result(timeout=60)


def test_an_abort_pause_ends_the_stream_in_flight(client: httpx.Client) -> None:
    body = {"model": SERVED_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            client.post, "/v1/completions", json={**body, "ignore_eos": True, "temperature": 0}
        )
        time.sleep(1.5)
        admin(client, "pause_generation", {"mode": "abort"})
        choice = running.result(timeout=60).json()["choices"][0]
    admin(client, "resume_generation")
    assert choice["finish_reason"] == "abort"


def test_a_client_gone_away_ends_its_request_in_vllm(client: httpx.Client) -> None:
    body = {"model": SERVED_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2000}
    body.update(ignore_eos=True, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as response:
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    # A pause that waits for the requests in flight returns at once: vLLM holds none.
    started = time.monotonic()
    admin(client, "pause_generation", {"mode": "wait"})
    waited = time.monotonic() - started
    admin(client, "resume_generation")
    assert waited < 10


def test_a_disk_update_changes_the_answer_and_another_brings_it_back(
    client: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    before = answer(client)
    changed = _with_first_mlp_negated(model_dir, tmp_path / "changed")
    admin(client, "pause_generation", {"mode": "wait"})
    try:
        update = admin(
            client, "update_weights_from_disk", {"model_path": str(changed), "weight_version": "v2"}
        )
        assert update["version"] == "v2"
    finally:
        admin(client, "resume_generation")
    assert answer(client) != before
    # vLLM's own dialect, run between engine steps: no pause asked.
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}
    reloaded = client.post("/collective_rpc", json=rpc)
    assert reloaded.status_code == 200, reloaded.text
    assert client.get("/health").json()["admin"]["state"] == "serving"
    assert answer(client) == before


def _with_first_mlp_negated(model_dir: Path, folder: Path) -> Path:
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = -tensors[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for kept in ("config.json", "generation_config.json"):
        (folder / kept).write_bytes((model_dir / kept).read_bytes())
    return folder


def test_sleep_on_the_cpu_says_it_freed_nothing(client: httpx.Client) -> None:
    slept = admin(client, "control/sleep", {"level": 1})
    try:
        assert slept["freed"] == [] and "nothing was freed" in slept["message"]
        health = client.get("/health").json()
        assert (
            health["admin"]["freed"] == [] and "nothing was freed" in health["admin"]["sleep_note"]
        )
    finally:
        admin(client, "control/wake_up")
    assert "Paris" in answer(client)


def test_what_vllm_cannot_do_is_a_400_naming_why(
    client: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    partial.mkdir()
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({name: load_file(model_dir / "model.safetensors")[name]}, partial / "w.safetensors")
    admin(client, "pause_generation", {"mode": "wait"})
    try:
        refusals = {
            "update_weights_from_distributed": (
                {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
                "weight-transfer engine",
            ),
            "update_weights_from_disk": ({"model_path": str(partial)}, "lacks 271 tensor(s)"),
        }
        for route, (body, reason) in refusals.items():
            refused = client.post(f"/engine/{route}", json=body)
            assert refused.status_code == 400, route
            assert reason in refused.json()["error"]["message"], route
    finally:
        admin(client, "resume_generation")
    assert "Paris" in answer(client)
    asked = {"model": SERVED_MODEL_NAME, "prompt": "hi", "max_tokens": 4, "prompt_logprobs": 1}
    unmapped = client.post("/v1/completions", json=asked)
    assert unmapped.status_code == 400
    assert "prompt_logprobs" in unmapped.text
    # vLLM reads JSON's whitespace rule from its engine config only: compact here.
    spaced = {"json": {"type": "object"}, "disable_any_whitespace": False}
    plain = {"model": SERVED_MODEL_NAME, "prompt": "hi", "max_tokens": 4}
    loose = client.post("/v1/completions", json={**plain, "structured_outputs": spaced})
    assert loose.status_code == 400
    assert "one whitespace rule" in loose.text


def test_tensor_pushes_change_the_answer_and_a_push_back_restores_it(
    client: httpx.Client, model_dir: Path
) -> None:
    from safetensors.torch import load_file

    before = answer(client)
    served = load_file(model_dir / "model.safetensors")
    negated = "model.layers.0.mlp.down_proj.weight"
    kept = "model.layers.1.mlp.down_proj.weight"

    def push(tensors: dict[str, Any], version: str) -> dict[str, Any]:
        body = {
            "serialized_named_tensors": [encode_safetensors(tensors)],
            "weight_version": version,
        }
        pushed = client.post("/update_weights_from_tensor", json=body)
        assert pushed.status_code == 200, pushed.text
        return pushed.json()

    assert push({negated: -served[negated]}, "t1")["weight_version"] == "t1"
    changed = answer(client)
    assert changed != before
    # A later push of another tensor keeps the earlier one: the model holds both.
    push({kept: served[kept]}, "t2")
    assert answer(client) == changed
    push({negated: served[negated]}, "t3")
    assert answer(client) == before
    assert admin(client, "control/get_weight_version")["version"] == "t3"


def test_a_push_of_an_unknown_name_or_shape_is_a_400_and_the_model_keeps_serving(
    client: httpx.Client,
) -> None:
    import torch

    before = answer(client)
    wrong = {
        "model.layers.0.mlp.not_a_weight": (torch.zeros(4), "not a tensor of this model"),
        "model.layers.0.mlp.down_proj.weight": (torch.zeros(3, 5), "shape [3, 5]"),
    }
    for name, (tensor, reason) in wrong.items():
        body = {"serialized_named_tensors": [encode_safetensors({name: tensor})]}
        refused = client.post("/update_weights_from_tensor", json=body)
        assert refused.status_code == 400, name
        assert reason in refused.json()["error"]["message"], name
    assert answer(client) == before


@pytest.fixture(scope="module")
def lora_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_lora(model_dir, tmp_path_factory.mktemp("lora"), seed=5)


def complete_tokens(client: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "The river runs", "max_tokens": 8, "temperature": 0}
    # Without the model's default repetition penalty (generation_config.json), which
    # peft's plain greedy run below does not apply.
    body.update(repetition_penalty=1.0, return_token_ids=True)
    return client.post("/v1/completions", json=body)


def test_a_lora_adapter_loads_answers_as_peft_does_and_unloads(
    client: httpx.Client, model_dir: Path, lora_dir: Path
) -> None:
    import torch

    base = complete_tokens(client, SERVED_MODEL_NAME).json()["choices"][0]
    load = {"lora_name": "river", "lora_path": str(lora_dir)}
    loaded = client.post("/v1/load_lora_adapter", json=load)
    assert loaded.status_code == 200, loaded.text
    assert "river" in {model["id"] for model in client.get("/v1/models").json()["data"]}
    adapted = complete_tokens(client, "river").json()["choices"][0]
    assert adapted["token_ids"] != base["token_ids"]
    prompt = base["prompt_token_ids"]
    # The server runs float32 (the checkpoint is bfloat16): peft's run is cast the same.
    assert adapted["token_ids"] == peft_greedy(model_dir, lora_dir, prompt, 8, torch.float32)
    assert complete_tokens(client, SERVED_MODEL_NAME).json()["choices"][0] == base

    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "river"})
    assert unloaded.status_code == 200, unloaded.text
    assert complete_tokens(client, "river").status_code == 404
    again = client.post("/v1/unload_lora_adapter", json={"lora_name": "river"})
    assert again.status_code == 404
    broken = client.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(model_dir)}
    )
    assert broken.status_code == 400
