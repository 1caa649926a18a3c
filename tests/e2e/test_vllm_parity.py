"""What a client written for vLLM notices, served as vLLM serves it: ``model`` left out,
OpenAI's own request fields, ``stop_reason``, vLLM's model card, ``/ping`` and ``/load``,
vLLM's metric families, and SGLang's empty media lists. The server runs strict
(``--no-allow-unknown-fields``): every field used here is one Penstock declares."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import running_server

MODEL = "sample-model"
HI = [{"role": "user", "content": "hi"}]
# OpenAI's request fields that ask nothing of a server like this one.
OPENAI_FIELDS = {
    "store": True,
    "metadata": {"run": "7"},
    "service_tier": "auto",
    "safety_identifier": "user-1",
    "prompt_cache_key": "conversation-1",
    "user": "user-1",
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    args = ["--engine", "sample", "--no-allow-unknown-fields", "--", "--delay", "0"]
    with running_server(args, tmp_path_factory.mktemp("parity")) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            yield http


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    assert "x-penstock-ignored-fields" not in response.headers
    body: dict[str, Any] = response.json()
    return body


def test_model_may_be_left_out_and_the_answer_names_the_served_one(client: httpx.Client) -> None:
    chat = ok(client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}))
    assert chat["model"] == MODEL
    completion = ok(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
    assert completion["model"] == MODEL
    assert ok(client.post("/v1/completions", json={"model": "", "prompt": "hi"}))["model"] == MODEL
    response = ok(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}))
    assert response["model"] == MODEL
    assert response["status"] in {"completed", "incomplete"}
    stored = ok(client.get(f"/v1/responses/{response['id']}"))
    assert stored["model"] == MODEL
    tokens = ok(client.post("/tokenize", json={"prompt": "hi"}))["tokens"]
    assert ok(client.post("/detokenize", json={"tokens": tokens}))["prompt"] == "hi"
    generate = ok(client.post("/generate", json={"text": "hi", "sampling_params": {}}))
    assert generate["text"]


def test_openais_own_request_fields_are_accepted(client: httpx.Client) -> None:
    chat_only = {"reasoning_effort": "low", "verbosity": "low", "modalities": ["text"]}
    body = {"messages": HI, "max_tokens": 2, **OPENAI_FIELDS, **chat_only}
    ok(client.post("/v1/chat/completions", json=body))
    ok(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **OPENAI_FIELDS}))
    audio = client.post("/v1/chat/completions", json={**body, "modalities": ["text", "audio"]})
    assert audio.status_code == 400
    assert audio.json()["error"]["param"].startswith("modalities")


def test_stop_reason_names_the_stop_string_that_ended_a_choice(client: httpx.Client) -> None:
    # The sample engine writes '!"#$%...': "#" is its third token.
    body = {"prompt": "hi", "max_tokens": 5, "stop": ["#"]}
    choice = ok(client.post("/v1/completions", json=body))["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ('!"', "stop", "#")
    long = ok(client.post("/v1/completions", json={**body, "stop": ["never"]}))["choices"][0]
    assert (long["finish_reason"], long["stop_reason"]) == ("length", None)
    chat = {"messages": HI, "max_tokens": 5, "stop": ["#"]}
    message = ok(client.post("/v1/chat/completions", json=chat))["choices"][0]
    assert message["stop_reason"] == "#"
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-2])["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "#")


def test_the_model_card_has_vllms_fields(client: httpx.Client) -> None:
    card = ok(client.get("/v1/models"))["data"][0]
    assert card["max_model_len"] == 2048
    assert (card["root"], card["parent"]) == (MODEL, None)
    assert card["permission"][0]["object"] == "model_permission"
    assert ok(client.get(f"/v1/models/{MODEL}"))["max_model_len"] == 2048


def test_ping_and_load_answer_as_vllms(client: httpx.Client) -> None:
    for method in ("GET", "POST"):
        ping = client.request(method, "/ping")
        assert (ping.status_code, ping.content) == (200, b"")
    assert ok(client.get("/load")) == {"server_load": 0}


def test_vllms_metric_families_are_served_beside_penstocks(client: httpx.Client) -> None:
    ok(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stop": ["#"]}))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
    }
    labels = (("engine", "0"), ("model_name", MODEL))
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert (name, labels) in samples, name
    stopped = (labels[0], ("finished_reason", "stop"), labels[1])
    assert samples[("vllm:request_success_total", stopped)] >= 1
    generated = samples[("vllm:generation_tokens_total", labels)]
    assert generated == samples[("penstock_frontend_output_tokens_total", (("model", MODEL),))]


def test_empty_media_lists_on_generate_are_no_media(client: httpx.Client) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    ok(client.post("/generate", json={**body, "image_data": [], "audio_data": []}))
    refused = client.post("/generate", json={**body, "image_data": ["data:image/png;base64,AA"]})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "image_data"
