"""Routing, LoRA adapters and metrics of ``penstock serve --ray``, and the transformers
engine under Ray, on the package's local two-node Ray cluster (``tests/ray/conftest.py``).

The sample-engine server lives for its class, then the transformers server for its own.
The module takes about 50-90 s on two cores (the sample fleet ~13 s and the transformers
fleet ~20-70 s to deploy, ~5-8 s each to stop; the requests take a few seconds).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

ray = pytest.importorskip(
    "ray", reason="Ray Serve is not installed: pip install 'penstock[ray]' to run tests/ray"
)
import safetensors.numpy  # noqa: E402
from openai import OpenAI  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tests.deploy.support import panel_queries  # noqa: E402
from tests.e2e.test_metrics import (  # noqa: E402
    FLEET_ONLY,
    assert_documented_families_present,
    documented_families,
)
from tests.support.ray_cluster import fleet_server  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]

MODEL = "sample-model"
ADMIN_KEY = "k"


def serve_fleet(cluster: Cluster, log_dir: Path, args: list[str]) -> Iterator[ServerProcess]:
    with fleet_server(
        cluster, log_dir, ["--admin-api-key", ADMIN_KEY, *args], ready_timeout=180
    ) as process:
        yield process


def served(server: ServerProcess) -> dict[str, int]:
    fleet = httpx.get(f"{server.base_url}/health", timeout=10).json()["fleet"]["replicas"]
    return {name: load["served"] for name, load in fleet.items()}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    changed = {name: count - before.get(name, 0) for name, count in after.items()}
    return {name: count for name, count in changed.items() if count}


def client_of(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat_tokens(client: OpenAI, model: str, **extra: Any) -> list[int]:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"return_token_ids": True},
        **extra,
    )
    return (reply.choices[0].model_extra or {})["token_ids"]


def write_adapter(folder: Path, shift: int) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4}))
    tensors = {"token_shift": np.array([shift], dtype=np.int64)}
    safetensors.numpy.save_file(tensors, folder / "adapter_model.safetensors")
    return folder


@pytest.fixture(scope="class")
def sample_server(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from serve_fleet(cluster, tmp_path_factory.mktemp("sample"), ["--engine", "sample"])


@pytest.fixture(scope="class")
def transformers_server(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    from tests.support.tiny_llm import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    args = ["--engine", "transformers", "--model", str(model_dir), "--", "--cpu-threads", "1"]
    yield from serve_fleet(cluster, tmp_path_factory.mktemp("transformers"), args)


class TestSampleFleet:
    def test_one_session_stays_on_one_replica_and_sessions_spread(
        self, sample_server: ServerProcess
    ) -> None:
        client = client_of(sample_server)
        before = served(sample_server)
        for _ in range(4):
            chat_tokens(client, MODEL, extra_headers={"X-Session-Id": "alice"})
        alice = delta(before, served(sample_server))
        assert list(alice.values()) == [4], alice

        before = served(sample_server)
        for _ in range(4):
            chat_tokens(client, MODEL, user="bob")
        assert list(delta(before, served(sample_server)).values()) == [4]

        before = served(sample_server)
        for i in range(16):
            chat_tokens(client, MODEL, user=f"user-{i}")
        spread = delta(before, served(sample_server))
        assert len(spread) == 2 and sum(spread.values()) == 16, spread

    def test_prompts_sharing_a_long_prefix_stay_on_one_replica(
        self, sample_server: ServerProcess
    ) -> None:
        client = client_of(sample_server)
        prefix = " ".join(f"word{i}" for i in range(80))
        before = served(sample_server)
        for i in range(4):
            client.completions.create(model=MODEL, prompt=f"{prefix} question {i}", max_tokens=2)
        assert list(delta(before, served(sample_server)).values()) == [4]

    def test_a_loaded_adapter_is_served_by_every_replica(
        self, sample_server: ServerProcess, tmp_path: Path
    ) -> None:
        adapter = write_adapter(tmp_path / "math", 50)
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        loaded = httpx.post(
            f"{sample_server.base_url}/v1/load_lora_adapter",
            json={"lora_name": "math", "lora_path": str(adapter)},
            headers=headers,
            timeout=60,
        )
        assert loaded.status_code == 200, loaded.text
        client = client_of(sample_server)
        base = chat_tokens(client, MODEL)
        before = served(sample_server)
        outputs = [chat_tokens(client, "math", user=f"user-{i}") for i in range(12)]
        assert len(delta(before, served(sample_server))) == 2
        assert all(tokens == outputs[0] for tokens in outputs) and outputs[0] != base

        unloaded = httpx.post(
            f"{sample_server.base_url}/v1/unload_lora_adapter",
            json={"lora_name": "math"},
            headers=headers,
            timeout=60,
        )
        assert unloaded.status_code == 200, unloaded.text
        gone = httpx.post(
            f"{sample_server.base_url}/v1/chat/completions",
            json={"model": "math", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert gone.status_code == 404

    def test_metrics_carry_every_replica(self, sample_server: ServerProcess) -> None:
        client = client_of(sample_server)
        for i in range(8):
            chat_tokens(client, MODEL, user=f"metrics-{i}")
        names = set(served(sample_server))
        text = httpx.get(f"{sample_server.base_url}/metrics", timeout=30).text
        fleet = [f for f in documented_families() if f.name.startswith(FLEET_ONLY)]
        assert_documented_families_present(text, fleet)
        replicas = {
            sample.labels.get("replica")
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if family.name == "penstock_component_forward_passes"
        }
        assert replicas == names
        # Every family the fleet dashboard reads is exported by a real fleet.
        exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        for query in panel_queries():
            if query.dashboard == "fleet":
                for family in re.findall(r"\b(penstock_[a-z_]+)\b", query.expr):
                    assert family in exported, query


class TestTransformersFleet:
    def test_chat_and_completions_stream_and_not_on_two_replicas(
        self, transformers_server: ServerProcess
    ) -> None:
        client = client_of(transformers_server)
        model = client.models.list().data[0].id
        before = served(transformers_server)
        # Twelve sessions: the chance that all prefer one of two replicas is 1 in 2048.
        for i in range(12):
            session = {"X-Session-Id": f"s{i}"}
            chat = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                temperature=0,
                extra_headers=session,
            )
            assert chat.usage is not None and chat.usage.completion_tokens >= 1
            pieces = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                temperature=0,
                stream=True,
                extra_headers=session,
            )
            text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
            assert text == chat.choices[0].message.content
            completion = client.completions.create(
                model=model, prompt="The river", max_tokens=4, temperature=0, extra_headers=session
            )
            streamed = client.completions.create(
                model=model,
                prompt="The river",
                max_tokens=4,
                temperature=0,
                stream=True,
                extra_headers=session,
            )
            assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
        assert len(delta(before, served(transformers_server))) == 2
