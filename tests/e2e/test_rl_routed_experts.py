"""SkyRL's ``/skyrl/v1/generate`` on a tiny random mixture-of-experts checkpoint (Qwen2-MoE)
served with ``--deterministic``: each choice's ``routed_experts``, packed as SkyRL decodes
them, are the experts the trainer's own forward pass routes every token to."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.server import ServerProcess, transformers_server
from tests.support.tiny_llm import build_tiny_moe

PROMPT = [5, 17, 29, 41, 8]
TOKENS = 5
TOP_K = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_moe(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with transformers_server(model_dir, tmp_path_factory.mktemp("logs"), "--deterministic") as up:
        yield up


def skyrl_body(base_url: str, **sampling: Any) -> dict[str, Any]:
    """``RemoteInferenceClient._generate_single``'s body."""
    model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
    params = {"max_tokens": TOKENS, "min_tokens": TOKENS, "temperature": 0.0, "logprobs": 0}
    return {"sampling_params": {**params, **sampling}, "model": model, "token_ids": PROMPT}


def unpacked(packed: dict[str, Any]) -> np.ndarray:
    """SkyRL's ``decode_packed_routed_experts``, its checks included."""
    dtype = np.dtype(packed["dtype"])
    array = np.frombuffer(base64.b64decode(packed["data"]), dtype=dtype).reshape(packed["shape"])
    top = int(array.max(initial=0))
    assert dtype == (np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32)
    return array


def trainer_routes(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """``[tokens, layers, top_k]``: each token's experts in one forward pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        output = model(torch.tensor([tokens]), output_router_logits=True)
    layers = [logits.topk(TOP_K, dim=-1).indices for logits in output.router_logits]
    return torch.stack(layers, dim=1).numpy()


def test_routed_experts_are_the_trainers(server: ServerProcess, model_dir: Path) -> None:
    answer = httpx.post(
        f"{server.base_url}/skyrl/v1/generate", json=skyrl_body(server.base_url), timeout=60
    )
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert len(choice["token_ids"]) == TOKENS
    routes = unpacked(choice["routed_experts"])
    # Every token that went through the model: the prompt and the output but its last.
    tokens = PROMPT + choice["token_ids"][:-1]
    assert routes.shape == (len(tokens), 2, TOP_K)
    assert (routes == trainer_routes(model_dir, tokens)).all()


def test_routed_experts_need_the_deterministic_engine(
    model_dir: Path, tmp_path: Path, server: ServerProcess
) -> None:
    streamed = httpx.post(
        f"{server.base_url}/skyrl/v1/generate",
        json={**skyrl_body(server.base_url), "stream": True},
        timeout=60,
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    with transformers_server(model_dir, tmp_path) as batched:
        refused = httpx.post(
            f"{batched.base_url}/skyrl/v1/generate", json=skyrl_body(batched.base_url), timeout=60
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "routed_experts"
