"""``trl vllm-serve``'s ``/chat/`` and ``/generate/`` with ``structured_outputs_regex``,
with the bodies TRL's ``VLLMClient`` sends, against ``penstock serve --engine
transformers`` on the tiny Llama (random weights: a completion matches the regex only
when the constraint holds it to it)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import ServerProcess, running_server, transformers_server
from tests.support.tiny_llm import build_tiny_llama

PATTERN = r"[a-c]{2}-\d{1,3}"
STOP = "<|im_end|>"
MESSAGES = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("served"))
    with transformers_server(model_dir, tmp_path_factory.mktemp("serve")) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        yield http


def client_body(**fields: Any) -> dict[str, Any]:
    """``VLLMClient``'s sampling fields with its defaults."""
    return {
        "n": 1,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": 16,
        "logprobs": 0,
        "structured_outputs_regex": None,
        "generation_kwargs": {},
        **fields,
    }


def chat_body(conversations: list[list[dict[str, Any]]], **fields: Any) -> dict[str, Any]:
    """``VLLMClient.chat``'s body."""
    return {
        "messages": conversations,
        **client_body(**fields),
        "chat_template_kwargs": {},
        "tools": None,
    }


def model_name(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def text_of(client: httpx.Client, ids: list[int]) -> str:
    """The completion's text; its ids end with the stop token when the model stopped."""
    body = {"model": model_name(client), "tokens": ids}
    return str(client.post("/detokenize", json=body).json()["prompt"]).removesuffix(STOP)


def answer(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_chat_renders_each_conversation_and_generates_from_it(client: httpx.Client) -> None:
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = answer(client.post("/chat/", json=chat_body([MESSAGES, other], temperature=0.0)))
    for conversation, prompt_ids in zip([MESSAGES, other], chat["prompt_ids"], strict=True):
        tokenize = {
            "model": model_name(client),
            "messages": conversation,
            "add_generation_prompt": True,
        }
        assert prompt_ids == answer(client.post("/tokenize", json=tokenize))["tokens"]
    # The same ids through ``/generate/`` give the same greedy completions.
    generate = client_body(prompts=chat["prompt_ids"], temperature=0.0)
    generated = answer(client.post("/generate/", json=generate))
    assert chat["completion_ids"] == generated["completion_ids"]
    for ids, logprobs, logprob_ids in zip(
        chat["completion_ids"], chat["logprobs"], chat["logprob_token_ids"], strict=True
    ):
        assert len(ids) > 0
        assert [pair[0] for pair in logprob_ids] == ids
        assert all(len(values) == 1 and values[0] <= 0.0 for values in logprobs)


def test_structured_outputs_regex_holds_every_completion(client: httpx.Client) -> None:
    body = client_body(prompts=["hello", "world"], n=2, structured_outputs_regex=PATTERN)
    generated = answer(client.post("/generate/", json=body))
    assert len(generated["completion_ids"]) == 4
    for ids in generated["completion_ids"]:
        assert re.fullmatch(PATTERN, text_of(client, ids))
    chat = answer(
        client.post("/chat/", json=chat_body([MESSAGES], structured_outputs_regex=PATTERN))
    )
    assert re.fullmatch(PATTERN, text_of(client, chat["completion_ids"][0]))


def test_bad_chat_bodies_are_400_naming_the_field(client: httpx.Client) -> None:
    empty = client.post("/chat/", json=chat_body([[]]))
    assert empty.status_code == 400
    assert empty.json()["error"]["param"].startswith("messages")
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"role": "user", "content": [{"type": "text", "text": "What?"}, picture]}]
    media = client.post("/chat/", json=chat_body([MESSAGES, parts]))
    assert media.status_code == 400
    assert media.json()["error"]["param"] == "messages[1][0].content"
    unknown = client.post("/chat/", json=chat_body([MESSAGES], generation_kwargs={"colour": 1}))
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "generation_kwargs.colour"


def test_an_engine_that_cannot_constrain_names_the_regex(tmp_path: Path) -> None:
    with running_server(["--engine", "sample"], tmp_path) as sample:
        body = client_body(prompts=["hello"], structured_outputs_regex=PATTERN)
        refused = httpx.post(f"{sample.base_url}/generate/", json=body)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "structured_outputs_regex"
