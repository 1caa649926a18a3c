"""``/v1/embeddings``, ``/classify`` and ``/pooling`` on real ``penstock serve`` processes
running the ``transformers-pooling`` engine over tiny random checkpoints, each vector
checked against the same checkpoint run directly with ``transformers``."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from tests.support.openai_spec import spec_errors
from tests.support.server import ServerProcess, running_servers
from tests.support.tiny_llm import build_tiny_llama
from tests.support.tiny_pooling import (
    BERT_CONTEXT,
    build_tiny_bert_embedder,
    build_tiny_reward_model,
)

TEXTS = ["def main():", "import sys", "return the quick brown fox", "class Widget(object): pass"]
TOLERANCE = 1e-5


def _pooling_args(folder: Path, name: str) -> list[str]:
    args = ["--engine", "transformers-pooling", "--model", str(folder), "--served-model-name", name]
    return [*args, "--", "--cpu-threads", "1"]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert_embedder(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("reward"))


@pytest.fixture(scope="module")
def servers(
    bert_folder: Path,
    llama_folder: Path,
    reward_folder: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, ServerProcess]]:
    """The module's four servers, started together: their start-ups overlap."""
    starts = {
        "bert": _pooling_args(bert_folder, "tiny-bert"),
        "llama": _pooling_args(llama_folder, "tiny-llama-embed"),
        "reward": _pooling_args(reward_folder, "tiny-reward"),
        "sample": ["--engine", "sample"],
    }
    logs = [(args, tmp_path_factory.mktemp(f"{name}-logs")) for name, args in starts.items()]
    with running_servers(logs, ready_timeout=120) as started:
        yield dict(zip(starts, started, strict=True))


@pytest.fixture(scope="module")
def bert(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["bert"]


@pytest.fixture(scope="module")
def llama(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["llama"]


@pytest.fixture(scope="module")
def reward(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["reward"]


@pytest.fixture(scope="module")
def sample(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["sample"]


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@torch.inference_mode()
def _direct_embeddings(folder: Path, texts: list[str], pooling: str) -> list[list[float]]:
    """Each text alone through ``transformers``: tokenized with special tokens, pooled,
    L2-normalised."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    vectors = []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        hidden = model(input_ids=ids).last_hidden_state[0]
        pooled = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
        vectors.append(torch.nn.functional.normalize(pooled, dim=0).tolist())
    return vectors


def _token_ids(folder: Path, texts: list[str]) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer(text)["input_ids"] for text in texts]


def _assert_close(got: list[list[float]], expected: list[list[float]]) -> None:
    assert len(got) == len(expected)
    for row, want in zip(got, expected, strict=True):
        assert len(row) == len(want)
        assert max(abs(a - b) for a, b in zip(row, want, strict=True)) < TOLERANCE


def test_mean_pooled_encoder_matches_transformers(bert: ServerProcess, bert_folder: Path) -> None:
    answer = _client(bert).embeddings.create(
        model="tiny-bert", input=TEXTS, encoding_format="float"
    )
    _assert_close(
        [item.embedding for item in answer.data], _direct_embeddings(bert_folder, TEXTS, "mean")
    )
    assert [item.index for item in answer.data] == list(range(len(TEXTS)))
    prompt_tokens = sum(len(ids) for ids in _token_ids(bert_folder, TEXTS))
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.total_tokens == prompt_tokens
    assert answer.model == "tiny-bert"


def test_the_answer_matches_the_openai_spec(bert: ServerProcess) -> None:
    answer = httpx.post(
        f"{bert.base_url}/v1/embeddings",
        json={"model": "tiny-bert", "input": TEXTS, "encoding_format": "float"},
    )
    assert answer.status_code == 200, answer.text
    assert spec_errors("CreateEmbeddingResponse", answer.json()) == []


def test_last_token_pooled_decoder_matches_transformers(
    llama: ServerProcess, llama_folder: Path
) -> None:
    answer = _client(llama).embeddings.create(
        model="tiny-llama-embed", input=TEXTS, encoding_format="float"
    )
    expected = _direct_embeddings(llama_folder, TEXTS, "last")
    _assert_close([item.embedding for item in answer.data], expected)


def test_a_string_and_token_ids_give_the_same_vectors(
    bert: ServerProcess, bert_folder: Path
) -> None:
    client = _client(bert)
    expected = _direct_embeddings(bert_folder, TEXTS, "mean")
    one = client.embeddings.create(model="tiny-bert", input=TEXTS[2], encoding_format="float")
    _assert_close([one.data[0].embedding], [expected[2]])
    ids = _token_ids(bert_folder, TEXTS)
    single = client.embeddings.create(model="tiny-bert", input=ids[1], encoding_format="float")
    _assert_close([single.data[0].embedding], [expected[1]])
    several = client.embeddings.create(model="tiny-bert", input=ids, encoding_format="float")
    _assert_close([item.embedding for item in several.data], expected)
    assert several.usage.prompt_tokens == sum(len(row) for row in ids)


def test_base64_is_little_endian_float32(bert: ServerProcess, bert_folder: Path) -> None:
    expected = _direct_embeddings(bert_folder, TEXTS[:2], "mean")
    # The openai client asks for base64 when no format is given, and decodes it itself.
    decoded = _client(bert).embeddings.create(model="tiny-bert", input=TEXTS[:2])
    _assert_close([item.embedding for item in decoded.data], expected)
    raw = httpx.post(
        f"{bert.base_url}/v1/embeddings",
        json={"model": "tiny-bert", "input": TEXTS[:2], "encoding_format": "base64"},
    ).json()
    vectors = [
        np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in raw["data"]
    ]
    _assert_close([v.tolist() for v in vectors], expected)


def test_dimensions_truncate_then_renormalise(bert: ServerProcess, bert_folder: Path) -> None:
    answer = _client(bert).embeddings.create(
        model="tiny-bert", input=TEXTS, dimensions=8, encoding_format="float"
    )
    expected = [
        (np.array(vector[:8]) / np.linalg.norm(vector[:8])).tolist()
        for vector in _direct_embeddings(bert_folder, TEXTS, "mean")
    ]
    _assert_close([item.embedding for item in answer.data], expected)
    assert all(
        math.isclose(np.linalg.norm(item.embedding), 1.0, rel_tol=1e-5) for item in answer.data
    )


def test_concurrent_requests_each_get_their_own_vectors(
    bert: ServerProcess, bert_folder: Path
) -> None:
    expected = _direct_embeddings(bert_folder, TEXTS, "mean")
    client = _client(bert)

    def embed(index: int) -> list[float]:
        text = TEXTS[index % len(TEXTS)]
        return (
            client.embeddings.create(model="tiny-bert", input=text, encoding_format="float")
            .data[0]
            .embedding
        )

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(embed, range(16)))
    _assert_close(got, [expected[i % len(TEXTS)] for i in range(16)])


@torch.inference_mode()
def _direct_rewards(folder: Path, texts: list[str]) -> list[float]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    return [model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item() for text in texts]


def test_pooling_returns_raw_rewards_and_classify_their_sigmoid(
    reward: ServerProcess, reward_folder: Path
) -> None:
    expected = _direct_rewards(reward_folder, TEXTS)
    pooled = httpx.post(
        f"{reward.base_url}/pooling",
        json={"model": "tiny-reward", "input": TEXTS, "use_activation": False},
    )
    assert pooled.status_code == 200, pooled.text
    body = pooled.json()
    assert [item["index"] for item in body["data"]] == list(range(len(TEXTS)))
    _assert_close([item["data"] for item in body["data"]], [[r] for r in expected])
    assert body["usage"]["prompt_tokens"] == sum(
        len(ids) for ids in _token_ids(reward_folder, TEXTS)
    )
    classified = httpx.post(
        f"{reward.base_url}/classify", json={"model": "tiny-reward", "input": TEXTS}
    )
    assert classified.status_code == 200, classified.text
    for item, logit in zip(classified.json()["data"], expected, strict=True):
        assert item["label"] == "reward"
        assert item["num_classes"] == 1
        assert abs(item["probs"][0] - 1 / (1 + math.exp(-logit))) < TOLERANCE


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty"),
        ({"input": ["fine", ""]}, "input", "input[1] is empty"),
        ({"input": [[2, 5], []]}, "input", "input[1] is empty"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": [2, 999_999, 3]}, "input", "outside the vocabulary"),
        ({"input": [[2] * (BERT_CONTEXT + 1)]}, "input", "context"),
        ({"input": " ".join(["return the quick brown fox"] * 20)}, "input", "context"),
        ({"input": "x", "dimensions": 0}, "dimensions", "between 1 and 32"),
        ({"input": "x", "dimensions": 33}, "dimensions", "between 1 and 32"),
    ],
)
def test_bad_embedding_input_is_400_naming_the_field(
    bert: ServerProcess, body: dict[str, object], param: str, says: str
) -> None:
    error = _error(
        httpx.post(f"{bert.base_url}/v1/embeddings", json={"model": "tiny-bert", **body}), 400
    )
    assert error["param"] == param
    assert says in str(error["message"])
    # The server keeps serving.
    assert _client(bert).embeddings.create(model="tiny-bert", input="ok").data


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimension": 8}, "dimension"),
        ({"input": [-1]}, "input"),
        ({"input": ["a", [1]]}, "input"),
    ],
)
def test_malformed_embedding_body_is_400_naming_the_field(
    bert: ServerProcess, body: dict[str, object], field: str
) -> None:
    error = _error(
        httpx.post(f"{bert.base_url}/v1/embeddings", json={"model": "tiny-bert", **body}), 400
    )
    assert field in str(error["param"])


def test_the_wrong_model_for_the_route_is_refused(
    bert: ServerProcess, reward: ServerProcess, sample: ServerProcess
) -> None:
    chat = httpx.post(
        f"{bert.base_url}/v1/chat/completions",
        json={"model": "tiny-bert", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert _error(chat, 400)["param"] == "model"
    completion = httpx.post(
        f"{bert.base_url}/v1/completions", json={"model": "tiny-bert", "prompt": "hi"}
    )
    assert _error(completion, 400)["param"] == "model"
    generate = httpx.post(f"{bert.base_url}/generate", json={"model": "tiny-bert", "text": "hi"})
    assert generate.status_code == 400, generate.text
    generation_only = httpx.post(
        f"{sample.base_url}/v1/embeddings", json={"model": "sample-model", "input": "hi"}
    )
    error = _error(generation_only, 400)
    assert error["param"] == "model"
    assert "does not serve embeddings" in str(error["message"])
    embedder_classify = httpx.post(
        f"{bert.base_url}/classify", json={"model": "tiny-bert", "input": "hi"}
    )
    assert _error(embedder_classify, 400)["param"] == "model"
    reward_embed = httpx.post(
        f"{reward.base_url}/v1/embeddings", json={"model": "tiny-reward", "input": "hi"}
    )
    assert _error(reward_embed, 400)["param"] == "model"
    wrong_task = httpx.post(
        f"{reward.base_url}/pooling", json={"model": "tiny-reward", "input": "hi", "task": "embed"}
    )
    assert _error(wrong_task, 400)["param"] == "task"
    unknown = httpx.post(f"{bert.base_url}/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert _error(unknown, 404)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        _client(sample).embeddings.create(model="sample-model", input="hi")
