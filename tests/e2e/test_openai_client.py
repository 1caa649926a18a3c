"""The official ``openai`` client against a real server, every payload checked against the
official OpenAI OpenAPI spec."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.openai_spec import spec_errors
from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("openai-client")
    with running_server(["--engine", "sample", "--", "--delay", "0"], log_dir) as process:
        yield process


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def assert_valid(schema: str, payload: object) -> None:
    assert spec_errors(schema, payload) == []


def assert_valid_completion_chunk(payload: dict) -> None:
    """The spec has no stream schema for legacy completions; its response schema demands a
    string finish_reason, while streams (OpenAI's own too) send null until the last chunk.
    Check exactly that relaxation and validate everything else against the spec."""
    choices = []
    for choice in payload["choices"]:
        assert choice["finish_reason"] in (None, "stop", "length")
        choices.append({**choice, "finish_reason": choice["finish_reason"] or "length"})
    assert_valid("CreateCompletionResponse", {**payload, "choices": choices})


def sse_payloads(response: httpx.Response) -> list[dict | str]:
    payloads: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def test_models_list(client: openai.OpenAI, raw: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert_valid("ListModelsResponse", raw.get("/v1/models").json())
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_non_stream(client: openai.OpenAI, raw: httpx.Client) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert completion.choices[0].message.content == '!"#$%'
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    assert_valid("CreateChatCompletionRequest", request)
    assert_valid(
        "CreateChatCompletionResponse", raw.post("/v1/chat/completions", json=request).json()
    )


def test_chat_stream_with_usage(client: openai.OpenAI, raw: httpx.Client) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == '!"#$%&'
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert_valid("CreateChatCompletionRequest", body)
    with raw.stream("POST", "/v1/chat/completions", json=body) as response:
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    for payload in payloads[:-1]:
        assert_valid("CreateChatCompletionStreamResponse", payload)


async def test_async_client_streams(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == '!"#$'
    completion = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert completion.choices[0].text == '!"'
    await client.close()


def test_completions_string_list_and_token_prompts(
    client: openai.OpenAI, raw: httpx.Client
) -> None:
    single = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
    assert single.choices[0].text == '!"#' and single.object == "text_completion"
    batch = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    tokens = client.completions.create(model=MODEL, prompt=[[5, 6], [7]], max_tokens=2)
    assert tokens.usage.prompt_tokens == 3
    for body in (
        {"model": MODEL, "prompt": "Once upon", "max_tokens": 3},
        {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 2},
    ):
        assert_valid("CreateCompletionRequest", body)
        assert_valid("CreateCompletionResponse", raw.post("/v1/completions", json=body).json())
    stream_body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with raw.stream("POST", "/v1/completions", json=stream_body) as response:
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    for payload in payloads[:-1]:
        assert_valid_completion_chunk(payload)


def test_n_choices_stream_interleaved_with_their_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2, stream=True
    )
    texts: dict[int, str] = {0: "", 1: ""}
    order = []
    finish = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.content:
                order.append(choice.index)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {0: '!"#', 1: '"#$'}
    assert order[:4] == [0, 1, 0, 1]
    assert finish == {0: "length", 1: "length"}


def test_stop_strings_are_removed_and_end_the_choice(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, stop=["$%"]
    )
    assert completion.choices[0].message.content == '!"#'
    assert completion.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt="x", max_tokens=10, stop="&", stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == '!"#$%'
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_in_openai_format(client: openai.OpenAI, raw: httpx.Client) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = completion.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["!", '"', "#"]
    assert content[0].bytes == [33]
    assert len(content[0].top_logprobs) == 2
    assert content[0].top_logprobs[0].token == "!"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    assert_valid("CreateChatCompletionResponse", raw.post("/v1/chat/completions", json=body).json())
    legacy = client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=1)
    assert legacy.choices[0].logprobs.tokens == ["!", '"']
    assert legacy.choices[0].logprobs.text_offset == [0, 1]


def test_return_token_ids_for_rl_trainers(raw: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "return_token_ids": True,
    }
    response = raw.post("/v1/chat/completions", json=body).json()
    assert len(response["prompt_token_ids"]) == response["usage"]["prompt_tokens"]
    assert len(response["choices"][0]["token_ids"]) == 3
    with raw.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        payloads = sse_payloads(stream)
    streamed = [t for p in payloads[1:-1] for t in p["choices"][0].get("token_ids", [])]
    assert streamed == response["choices"][0]["token_ids"]
    assert payloads[0]["choices"][0]["prompt_token_ids"] == response["prompt_token_ids"]


def test_continuous_usage_stats(raw: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    with raw.stream("POST", "/v1/completions", json=body) as response:
        payloads = sse_payloads(response)
    assert [p["usage"]["completion_tokens"] for p in payloads[:-1]] == [1, 2, 3]


def test_request_id_is_echoed(raw: httpx.Client) -> None:
    response = raw.get("/v1/models", headers={"X-Request-Id": "trace-me-42"})
    assert response.headers["x-request-id"] == "trace-me-42"
    generated = raw.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert len(generated.headers["x-request-id"]) == 36


def test_model_ids_may_contain_slashes(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--served-model-name", "org/tiny-v1", "--", "--delay", "0"]
    with running_server(args, tmp_path) as server:
        response = httpx.get(f"{server.base_url}/v1/models/org/tiny-v1")
        assert response.status_code == 200 and response.json()["id"] == "org/tiny-v1"
        missing = httpx.get(f"{server.base_url}/v1/models/org/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"


def test_metadata_upload_needs_an_operator_root(raw: httpx.Client, tmp_path: Path) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "nvext": {"metadata_upload": {"url": f"file://{tmp_path}/rollout-7"}},
    }
    response = raw.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "metadata uploads are not enabled on this server",
        "type": "invalid_request_error",
        "param": "nvext.metadata_upload",
        "code": "metadata_upload_disabled",
    }
    assert list(tmp_path.iterdir()) == []
