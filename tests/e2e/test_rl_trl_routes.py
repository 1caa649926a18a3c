"""``trl vllm-serve``'s ``/chat/`` and ``/generate/`` with ``structured_outputs_regex``,
and its teacher logprobs (``/get_sequence_logprobs/``), with the bodies TRL's
``VLLMClient`` sends, against ``penstock serve --engine transformers`` on the tiny Llama
(random weights: a completion matches the regex only when the constraint holds it to it;
teacher logprobs are held against the trainer's own forward pass)."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.server import ServerProcess, running_server, transformers_server
from tests.support.tiny_llm import build_tiny_llama

PATTERN = r"[a-c]{2}-\d{1,3}"
STOP = "<|im_end|>"
MESSAGES = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
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
    # A field vLLM does not define is ignored, as vLLM ignores it, and named.
    unknown = client.post("/chat/", json=chat_body([MESSAGES], generation_kwargs={"colour": 1}))
    assert unknown.status_code == 200, unknown.text
    assert unknown.headers["x-penstock-ignored-fields"] == "generation_kwargs.colour"


def test_an_engine_that_cannot_constrain_or_score_names_the_field(tmp_path: Path) -> None:
    with running_server(["--engine", "sample"], tmp_path) as sample:
        body = client_body(prompts=["hello"], structured_outputs_regex=PATTERN)
        refused = httpx.post(f"{sample.base_url}/generate/", json=body)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "structured_outputs_regex"
        scoring = sequence_logprobs_body(1, 1.0, "json")
        refused = httpx.post(f"{sample.base_url}/get_sequence_logprobs/", json=scoring)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "sequences"


SEQUENCES = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42], [7, 9]]
PROMPT_LENGTHS = [5, 0, 2]


def sequence_logprobs_body(
    top_logprobs: int, temperature: float, response_format: str
) -> dict[str, Any]:
    """``VLLMClient.get_sequence_logprobs``'s body."""
    return {
        "sequences": SEQUENCES,
        "prompt_lengths": PROMPT_LENGTHS,
        "top_logprobs": top_logprobs,
        "temperature": temperature,
        "response_format": response_format,
    }


def teacher_rows(model_dir: Path, temperature: float) -> list[torch.Tensor]:
    """The trainer's logprobs of each sequence's next token, one forward pass each."""
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for ids in SEQUENCES:
            logits = trainer(torch.tensor([ids])).logits[0].float()
            rows.append(torch.log_softmax(logits / temperature, -1))
    return rows


def test_sequence_logprobs_are_the_trainers(client: httpx.Client, model_dir: Path) -> None:
    expected = teacher_rows(model_dir, 0.7)
    body = sequence_logprobs_body(3, 0.7, "json")
    scored = answer(client.post("/get_sequence_logprobs/", json=body))
    for ids, length, rows, logprobs, token_ids in zip(
        SEQUENCES,
        PROMPT_LENGTHS,
        expected,
        scored["logprobs"],
        scored["logprob_token_ids"],
        strict=True,
    ):
        assert len(logprobs) == len(token_ids) == len(ids) - length
        for position, (values, tokens) in enumerate(
            zip(logprobs, token_ids, strict=True), start=length
        ):
            if position == 0:
                assert values == tokens == []
                continue
            row = rows[position - 1]
            best = row.topk(3).indices.tolist()
            assert tokens[:3] == best
            assert tokens == (best if ids[position] in best else [*best, ids[position]])
            assert values == pytest.approx(row[tokens].tolist(), abs=1e-5)


def decoded(scored: dict[str, Any], key: str, dtype: Any, last: int) -> np.ndarray:
    shape = [*scored["shape"][:2], last]
    return np.frombuffer(base64.b64decode(scored[key]), dtype=dtype).reshape(shape)


def test_binary_sequence_logprobs_are_padded_arrays(client: httpx.Client, model_dir: Path) -> None:
    (rows, *_) = teacher_rows(model_dir, 1.0)
    body = sequence_logprobs_body(2, 1.0, "binary")
    scored = answer(client.post("/get_sequence_logprobs/", json=body))
    assert scored["shape"] == [3, 3, 2] and scored["completion_lengths"] == [3, 3, 0]
    top = decoded(scored, "logprobs_b64", np.float32, 2)
    top_ids = decoded(scored, "token_ids_b64", np.int32, 2)
    actual = decoded(scored, "actual_logprobs_b64", np.float32, 1)
    actual_ids = decoded(scored, "actual_token_ids_b64", np.int32, 1)
    for t, token in enumerate(SEQUENCES[0][5:]):
        row = rows[4 + t]
        assert top_ids[0, t].tolist() == row.topk(2).indices.tolist()
        assert top[0, t] == pytest.approx(row.topk(2).values.tolist(), abs=1e-5)
        assert actual_ids[0, t, 0] == token
        assert actual[0, t, 0] == pytest.approx(float(row[token]), abs=1e-5)
    # Position 0 has no logprob; the third sequence has no completion.
    assert actual[1, 0, 0] == -np.inf and top[1, 0].tolist() == [-np.inf, -np.inf]
    assert (actual[2] == -np.inf).all() and (top_ids[2] == 0).all()


def test_bad_sequence_logprobs_bodies_are_400_naming_the_field(client: httpx.Client) -> None:
    cases = {
        "prompt_lengths": {"prompt_lengths": [1]},
        "prompt_lengths[2]": {"prompt_lengths": [5, 0, 3]},
        "top_logprobs": {"top_logprobs": 100},
        "temperature": {"temperature": 0},
        "response_format": {"response_format": "numpy"},
        "sequences[1]": {"sequences": [[1], [], [2]]},
        "sequences": {"sequences": [[1], [10**9], [2]], "prompt_lengths": [0, 0, 0]},
    }
    for param, fields in cases.items():
        body = {**sequence_logprobs_body(1, 1.0, "json"), **fields}
        refused = client.post("/get_sequence_logprobs/", json=body)
        assert refused.status_code == 400, (param, refused.text)
        assert refused.json()["error"]["param"].startswith(param), (param, refused.text)
    # A field TRL's server does not define is ignored, as its pydantic models ignore it.
    body = {**sequence_logprobs_body(1, 1.0, "json"), "colour": 1}
    assert client.post("/get_sequence_logprobs/", json=body).status_code == 200
