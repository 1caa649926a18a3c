"""The fields of SGLang's and vLLM's request models, as RL trainers send them, against a
real ``penstock serve`` (sample engine): each is honoured, or refused with a 400 naming
it; an unknown field is named by its path at any depth, and ``--allow-unknown-fields``
reaches every depth.

The sample engine answers prompt ``p`` with the ordinary tokens after its rotation, text
``!"#$%&'(...`` for the default weights, which lets the stop-string tests know the text.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from penstock.engines.samples.engine import SAMPLE_TOKENIZER_DIR
from tests.support.server import ServerProcess, running_server

MODEL = "sample-model"
ADMIN_KEY = "fields-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

# What slime's rollout sends on every sample (``slime/rollout/sglang_rollout.py``):
# ``sampling_params`` built from its rollout arguments, ``return_logprob`` and the prompt
# as ids.
SLIME_SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 6,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--engine", "sample", "--admin-api-key", ADMIN_KEY, "--no-allow-unknown-fields"]
    with running_server(args, tmp_path_factory.mktemp("fields")) as running:
        yield running


@pytest.fixture(scope="module")
def lenient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    args = ["--engine", "sample", "--allow-unknown-fields"]
    with running_server(args, tmp_path_factory.mktemp("lenient")) as running:
        with httpx.Client(base_url=running.base_url, timeout=60) as http:
            yield http


@pytest.fixture(scope="module")
def with_bos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A server whose tokenizer puts a BOS token (``<|im_start|>``, id 1) before an input,
    as Llama 3's does."""
    folder = Path(shutil.copytree(SAMPLE_TOKENIZER_DIR, tmp_path_factory.mktemp("bos") / "tok"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "bos_token": "<|im_start|>"}))
    tokenizer_path = folder / "tokenizer.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
        },
    }
    tokenizer_path.write_text(json.dumps(tokenizer))
    args = ["--engine", "sample", "--tokenizer", str(folder)]
    with running_server(args, tmp_path_factory.mktemp("bos-serve")) as running:
        with httpx.Client(base_url=running.base_url, timeout=60) as http:
            yield http


def error_of(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_slime_rollout_body_is_served_with_its_logprobs(client: httpx.Client) -> None:
    body = {"sampling_params": SLIME_SAMPLING, "return_logprob": True, "input_ids": [5, 6, 7]}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    output = response.json()
    triples = output["meta_info"]["output_token_logprobs"]
    # slime reads the tokens and the logprobs from the triples, and the text.
    assert [triple[1] for triple in triples] == output["output_ids"]
    assert len(triples) == 6 and all(triple[0] <= 0.0 for triple in triples)
    assert output["text"] == '!"#$%&'


def test_no_stop_trim_keeps_the_stop_string(client: httpx.Client) -> None:
    def text(no_stop_trim: bool) -> str:
        params = {**SLIME_SAMPLING, "stop": ["#"], "no_stop_trim": no_stop_trim}
        response = client.post("/generate", json={"input_ids": [5], "sampling_params": params})
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["finish_reason"]["type"] == "stop"
        return str(response.json()["text"])

    assert text(True) == '!"#'
    assert text(False) == '!"'


def test_return_text_in_logprobs_names_each_token(client: httpx.Client) -> None:
    body = {
        "input_ids": [5],
        "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    triples = client.post("/generate", json=body).json()["meta_info"]["output_token_logprobs"]
    assert [triple[2] for triple in triples] == ["!", '"', "#"]


def test_sampling_seed_is_the_seed(client: httpx.Client) -> None:
    def ids(params: dict[str, Any]) -> list[int]:
        body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 4, **params}}
        response = client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return list(response.json()["output_ids"])

    assert ids({"sampling_seed": 7}) == ids({"seed": 7})


@pytest.mark.parametrize(
    ("where", "body", "param"),
    [
        ("nested", {"sampling_params": {"max_new_tokens": 2, "foo": 1}}, "sampling_params.foo"),
        ("top level", {"prompt": "hi"}, "prompt"),
        ("top level", {"max_tokens": 3}, "max_tokens"),
        ("top level", {"min_tokens": 1}, "min_tokens"),
        ("top level", {"logprobs": 2}, "logprobs"),
    ],
)
def test_generate_names_an_unknown_field_at_any_depth(
    client: httpx.Client, where: str, body: dict[str, Any], param: str
) -> None:
    error = error_of(client.post("/generate", json={"input_ids": [5], **body}))
    assert error["code"] == "unknown_field"
    assert error["param"] == param
    assert param in error["message"]
    # The server keeps serving.
    assert client.post("/generate", json={"input_ids": [5]}).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ({"sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"image_data": ["data:image/png;base64,AAAA"]}, "image_data"),
        ({"logprob_start_len": 0, "return_logprob": True}, "logprob_start_len"),
    ],
)
def test_generate_refuses_what_it_cannot_honour_by_name(
    client: httpx.Client, body: dict[str, Any], param: str
) -> None:
    error = error_of(client.post("/generate", json={"input_ids": [5], **body}))
    assert error["code"] == "unsupported_parameter"
    assert error["param"] == param
    assert "not supported" in error["message"]


def test_generate_accepts_those_fields_at_the_value_that_asks_for_nothing(
    client: httpx.Client,
) -> None:
    # slime adds ``custom_params`` whenever its top_p is below 1.
    sampling = {
        "n": 1,
        "regex": None,
        "stream_interval": 1,
        "top_p": 0.9,
        "custom_params": {"return_top_p_token_ids": True},
    }
    body = {
        "input_ids": [5],
        "sampling_params": sampling,
        "return_hidden_states": False,
        "logprob_start_len": -1,
        "log_metrics": True,
    }
    assert client.post("/generate", json=body).status_code == 200


def test_vllm_output_fields_on_completions(client: httpx.Client) -> None:
    def text(**fields: Any) -> str:
        body = {"model": MODEL, "prompt": [5], "max_tokens": 8, "stop": ["#"], **fields}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    assert text(include_stop_str_in_output=True, skip_special_tokens=False) == '!"#'
    assert text(include_stop_str_in_output=False, spaces_between_special_tokens=False) == '!"'


def test_vllm_fields_on_chat(client: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "cache_salt": "v1",
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    error = error_of(client.post("/v1/chat/completions", json={**body, "use_beam_search": True}))
    assert (error["param"], error["code"]) == ("use_beam_search", "unsupported_parameter")


def test_chat_names_an_unknown_field_inside_a_message(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "colour": "red"}]}
    error = error_of(client.post("/v1/chat/completions", json=body))
    assert (error["param"], error["code"]) == ("messages[0].colour", "unknown_field")


def test_completions_refuse_prompt_logprobs_by_name(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [5], "prompt_logprobs": 1}
    error = error_of(client.post("/v1/completions", json=body))
    assert (error["param"], error["code"]) == ("prompt_logprobs", "unsupported_parameter")


def test_tokenize_takes_skyrls_body(client: httpx.Client) -> None:
    # SkyRL's ``tokenize`` without a local tokenizer: one request per text.
    body = {"model": MODEL, "prompt": "hello world", "add_special_tokens": False}
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    detok = client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert detok.json()["prompt"] == "hello world"
    error = error_of(client.post("/tokenize", json={**body, "chat_template": "{{ x }}"}))
    assert (error["param"], error["code"]) == ("chat_template", "unsupported_parameter")
    error = error_of(client.post("/tokenize", json={**body, "truncate": 3}))
    assert (error["param"], error["code"]) == ("truncate", "unknown_field")


def test_add_special_tokens_puts_the_bos_token_first(with_bos: httpx.Client) -> None:
    def tokens(**fields: Any) -> list[int]:
        body = {"model": MODEL, "prompt": "hello world", **fields}
        return list(with_bos.post("/tokenize", json=body).json()["tokens"])

    # vLLM's defaults: a prompt gets the BOS token unless asked not to; messages do not.
    plain = tokens(add_special_tokens=False)
    assert plain[0] != 1
    assert tokens() == tokens(add_special_tokens=True) == [1, *plain]
    messages = [{"role": "user", "content": "hi"}]
    chat = tokens(prompt=None, messages=messages)
    assert chat == tokens(prompt=None, messages=messages, add_special_tokens=False)

    def prompt_tokens(**fields: Any) -> int:
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 1, **fields}
        return int(with_bos.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"])

    assert prompt_tokens() == prompt_tokens(add_special_tokens=False) + 1
    assert prompt_tokens() == prompt_tokens(add_special_tokens=True)

    # Chat: the template writes its own special tokens; asked, the tokenizer's come too.
    def chat_prompt_tokens(**fields: Any) -> int:
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, **fields}
        response = with_bos.post("/v1/chat/completions", json=body)
        return int(response.json()["usage"]["prompt_tokens"])

    assert chat_prompt_tokens() == len(chat)
    assert chat_prompt_tokens(add_special_tokens=True) == len(chat) + 1


def test_allow_unknown_fields_reaches_every_depth(lenient: httpx.Client) -> None:
    generate = {"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "future": 1}}
    assert lenient.post("/generate", json={**generate, "also_future": True}).status_code == 200
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi", "colour": "red"}],
        "max_tokens": 2,
    }
    assert lenient.post("/v1/chat/completions", json=chat).status_code == 200
    tokens = {"token_ids": [5], "sampling_params": {"max_tokens": 2, "future": 1}}
    assert lenient.post("/inference/v1/generate", json=tokens).status_code == 200
    # A known field the server cannot honour is still refused: ignoring it would lose it.
    refused = lenient.post("/generate", json={"input_ids": [5], "sampling_params": {"regex": "a"}})
    assert error_of(refused)["param"] == "sampling_params.regex"


def test_health_generate_while_asleep_is_a_503_logged_as_a_warning(
    client: httpx.Client, server: ServerProcess
) -> None:
    assert client.post("/release_memory_occupation", json={}, headers=ADMIN).status_code == 200
    try:
        response = client.get("/health_generate")
        assert response.status_code == 503
        assert "sleeping" in response.json()["error"]["message"]
    finally:
        assert client.post("/resume_memory_occupation", json={}, headers=ADMIN).status_code == 200
    assert client.get("/health_generate").status_code == 200
    lines = [line for line in server.log().splitlines() if "health_generate:" in line]
    assert lines and all(" WARNING " in line for line in lines)
    assert not [line for line in server.log().splitlines() if " ERROR " in line]
