"""Logprobs an RL trainer can use as they come: a real ``penstock serve`` on a tiny float32
Llama checkpoint, its answers held against the trainer's own forward pass,
``log_softmax(model(input_ids).logits.float())`` of the same checkpoint in this process.

With ``--deterministic`` the logprobs ``/generate`` returns equal the trainer's exactly, and
a request answers the same alone and beside eight others. vLLM's ``prompt_logprobs`` (on
``/inference/v1/generate`` and ``/v1/completions``) and SGLang's ``logprob_start_len`` give
the trainer's logprobs of the prompt in each one's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.server import ServerProcess, running_servers, transformers_args
from tests.support.tiny_llm import build_tiny_llama

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41]
# Prompts of other lengths and tokens, run beside ``PROMPT``.
OTHERS = [[5 + i, 30 + i, 7, 8 + i] * (1 + i % 3) for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("on-policy-llama"))


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def trainer_logprobs(trainer: Any, token_ids: list[int]) -> torch.Tensor:
    """The trainer's recomputation: one forward pass over the whole sequence, on one CPU
    thread as the server runs (``transformers_server``): a matrix product split over more
    threads sums in another order, and on some CPUs that moves the last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            logits = trainer(torch.tensor([token_ids])).logits
    finally:
        torch.set_num_threads(threads)
    return torch.log_softmax(logits.float(), -1)[0]


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    """The ``--deterministic`` server and the default one, started together."""
    starts = [
        (transformers_args(model_dir, "--deterministic"), tmp_path_factory.mktemp("deterministic")),
        (transformers_args(model_dir), tmp_path_factory.mktemp("default")),
    ]
    with running_servers(starts, env={"HF_HUB_OFFLINE": "1"}, ready_timeout=120) as started:
        yield started


@pytest.fixture(scope="module")
def deterministic(servers: list[ServerProcess]) -> str:
    return servers[0].base_url


@pytest.fixture(scope="module")
def server(servers: list[ServerProcess]) -> ServerProcess:
    return servers[1]


def served_model(server: ServerProcess) -> str:
    return str(httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"])


def sglang_generate(base_url: str, input_ids: list[int], **fields: Any) -> dict[str, Any]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
        **fields,
    }
    body["sampling_params"]["seed"] = 7
    response = httpx.post(f"{base_url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_deterministic_logprobs_equal_the_trainers_forward_pass(
    deterministic: str, trainer: Any
) -> None:
    answer = sglang_generate(deterministic, PROMPT, top_logprobs_num=3)
    meta = answer["meta_info"]
    output = answer["output_ids"]
    assert len(output) == 12
    expected = trainer_logprobs(trainer, PROMPT + output)
    for position, (logprob, token, _) in enumerate(meta["output_token_logprobs"]):
        row = expected[len(PROMPT) - 1 + position]
        assert token == output[position]
        assert logprob == float(row[token])
        best = row.topk(3)
        tops = meta["output_top_logprobs"][position]
        assert [entry[1] for entry in tops] == best.indices.tolist()
        assert [entry[0] for entry in tops] == best.values.tolist()


def test_deterministic_answers_do_not_depend_on_the_batch(deterministic: str) -> None:
    alone = sglang_generate(deterministic, PROMPT)
    with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
        beside = [pool.submit(sglang_generate, deterministic, ids) for ids in OTHERS]
        batched = pool.submit(sglang_generate, deterministic, PROMPT)
        for future in beside:
            future.result()
        together = batched.result()
    assert together["output_ids"] == alone["output_ids"]
    assert (
        together["meta_info"]["output_token_logprobs"]
        == (alone["meta_info"]["output_token_logprobs"])
    )


def test_capabilities_declare_the_mode(deterministic: str, server: ServerProcess) -> None:
    on = httpx.get(f"{deterministic}/engine/capabilities", timeout=30).json()
    off = httpx.get(f"{server.base_url}/engine/capabilities", timeout=30).json()
    assert (on["deterministic"], off["deterministic"]) == (True, False)


def check_prompt_logprobs(
    positions: list[Any], prompt: list[int], expected: torch.Tensor, top: int
) -> None:
    """vLLM's shape: None first, then the prompt's token and the ``top`` most likely."""
    assert positions[0] is None
    assert len(positions) == len(prompt)
    for index, token in enumerate(prompt[1:], start=1):
        row = expected[index - 1]
        entries = positions[index]
        own = entries[str(token)]
        assert next(iter(entries)) == str(token)
        assert own["logprob"] == float(row[token])
        assert own["rank"] == int((row > row[token]).sum()) + 1
        assert isinstance(own["decoded_token"], str)
        best = row.topk(top)
        for place, (other, logprob) in enumerate(
            zip(best.indices.tolist(), best.values.tolist(), strict=True), start=1
        ):
            assert entries[str(other)]["logprob"] == logprob
            assert entries[str(other)]["rank"] == place


def test_prime_rl_prefill_logprobs_equal_the_trainers(server: ServerProcess, trainer: Any) -> None:
    # What prime-rl's ``prefill_logprobs`` sends to score a sequence.
    sampling = {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1}
    body = {"model": served_model(server), "token_ids": PROMPT, "sampling_params": sampling}
    response = httpx.post(f"{server.base_url}/inference/v1/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    positions = response.json()["prompt_logprobs"]
    check_prompt_logprobs(positions, PROMPT, trainer_logprobs(trainer, PROMPT), 1)


def test_completions_prompt_logprobs_on_each_choice(server: ServerProcess, trainer: Any) -> None:
    model = served_model(server)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "n": 2, "prompt_logprobs": 4}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    expected = trainer_logprobs(trainer, PROMPT)
    choices = response.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        check_prompt_logprobs(choice["prompt_logprobs"], PROMPT, expected, 4)


def test_echo_with_logprobs_covers_the_prompt(server: ServerProcess, trainer: Any) -> None:
    # vLLM's rule: echoed logprobs open with the prompt's, the first token's None.
    body = {"model": served_model(server), "prompt": PROMPT, "max_tokens": 2, "echo": True}
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={**body, "logprobs": 2}, timeout=60
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 2
    expected = trainer_logprobs(trainer, PROMPT)
    values = logprobs["token_logprobs"]
    assert values[0] is None and logprobs["top_logprobs"][0] is None
    assert values[1 : len(PROMPT)] == [
        float(expected[index - 1][token]) for index, token in enumerate(PROMPT[1:], start=1)
    ]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert len(choice["text"]) >= offsets[-1]
    check_prompt_logprobs(choice["prompt_logprobs"], PROMPT, expected, 2)


def test_chat_prompt_logprobs_cover_the_rendered_conversation(
    server: ServerProcess, trainer: Any
) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 2, "return_token_ids": True}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    prompt = answer["prompt_token_ids"]
    check_prompt_logprobs(answer["prompt_logprobs"], prompt, trainer_logprobs(trainer, prompt), 2)
    streamed = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    )
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"


def test_sglang_input_token_logprobs_from_logprob_start_len(
    server: ServerProcess, trainer: Any
) -> None:
    expected = trainer_logprobs(trainer, PROMPT)
    for start in (0, 4):
        meta = sglang_generate(
            server.base_url, PROMPT, logprob_start_len=start, top_logprobs_num=2
        )["meta_info"]
        triples = meta["input_token_logprobs"]
        assert [token for _, token, _ in triples] == PROMPT[start:]
        values = [logprob for logprob, _, _ in triples]
        if start == 0:
            assert values[0] is None and meta["input_top_logprobs"][0] is None
            values, tops = values[1:], meta["input_top_logprobs"][1:]
        else:
            tops = meta["input_top_logprobs"]
        positions = range(max(start, 1), len(PROMPT))
        assert values == [float(expected[i - 1, PROMPT[i]]) for i in positions]
        for i, top in zip(positions, tops, strict=True):
            assert [token for _, token, _ in top] == expected[i - 1].topk(2).indices.tolist()


@pytest.mark.parametrize("value", [-1, 21, "one"])
def test_bad_prompt_logprobs_are_a_400_naming_the_field(server: ServerProcess, value: Any) -> None:
    model = served_model(server)
    for path, body, param in (
        (
            "/inference/v1/generate",
            {"model": model, "token_ids": PROMPT, "sampling_params": {"prompt_logprobs": value}},
            "sampling_params.prompt_logprobs",
        ),
        ("/v1/completions", {"model": model, "prompt": PROMPT, "prompt_logprobs": value}, None),
    ):
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == (param or "prompt_logprobs"), error
        assert "prompt_logprobs" in error["message"]


def test_bad_logprob_start_len_is_a_400_naming_it(server: ServerProcess) -> None:
    for start in (len(PROMPT), -2):
        body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start}
        response = httpx.post(f"{server.base_url}/generate", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "logprob_start_len"


def test_deterministic_stream_carries_the_same_logprobs(deterministic: str) -> None:
    # A choice's chunks with logprobs are held until it ends, then sent together.
    model = str(httpx.get(f"{deterministic}/v1/models").json()["data"][0]["id"])
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "logprobs": 0, "seed": 3}
    whole = httpx.post(f"{deterministic}/v1/completions", json=body, timeout=60).json()
    streamed: list[float] = []
    with httpx.stream(
        "POST", f"{deterministic}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["logprobs"]:
                    streamed += choice["logprobs"]["token_logprobs"]
    assert streamed == whole["choices"][0]["logprobs"]["token_logprobs"]
    assert len(streamed) == 8


def test_trl_generate_names_prompt_logprobs_it_cannot_return(server: ServerProcess) -> None:
    body = {"prompts": [PROMPT], "max_tokens": 2, "generation_kwargs": {"prompt_logprobs": 1}}
    response = httpx.post(f"{server.base_url}/generate/", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "generation_kwargs.prompt_logprobs"
