"""verl's ``reward_score``: SGLang's ``/classify`` body against ``penstock serve --engine
transformers-pooling`` on a tiny random reward model; each score is the model's own raw
logit, as ``transformers`` computes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.support.server import ServerProcess, running_server
from tests.support.tiny_pooling import build_tiny_reward_model

TEXTS = ["def main():", "return the quick brown fox"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("reward"))


@pytest.fixture(scope="module")
def reward(
    reward_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--engine", "transformers-pooling", "--model", str(reward_folder)]
    args += ["--served-model-name", "tiny-reward", "--", "--cpu-threads", "1"]
    with running_server(args, tmp_path_factory.mktemp("logs"), ready_timeout=120) as server:
        yield server


@torch.inference_mode()
def direct_scores(folder: Path, texts: list[str]) -> list[float]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    return [model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item() for text in texts]


def test_verl_reward_score_reads_raw_scores(reward: ServerProcess, reward_folder: Path) -> None:
    expected = direct_scores(reward_folder, TEXTS)
    # ``reward_score(prompt=...)``: its body with the None fields dropped.
    one = httpx.post(f"{reward.base_url}/classify", json={"text": TEXTS[0]})
    assert one.status_code == 200, one.text
    answer = one.json()
    assert abs(answer["embedding"][0] - expected[0]) < TOLERANCE
    assert answer["meta_info"]["prompt_tokens"] > 0
    batch = httpx.post(f"{reward.base_url}/classify", json={"text": TEXTS, "rid": ["a", "b"]})
    assert batch.status_code == 200, batch.text
    scores = [item["embedding"][0] for item in batch.json()]
    assert scores == pytest.approx(expected, abs=TOLERANCE)
    assert [item["meta_info"]["id"] for item in batch.json()] == ["a", "b"]
    # ``reward_score(input_ids=...)`` with the tokens of the first text.
    ids = AutoTokenizer.from_pretrained(reward_folder)(TEXTS[0])["input_ids"]
    by_ids = httpx.post(f"{reward.base_url}/classify", json={"input_ids": ids})
    assert by_ids.status_code == 200, by_ids.text
    assert abs(by_ids.json()["embedding"][0] - expected[0]) < TOLERANCE
    # vLLM's body still answers in vLLM's shape.
    vllm = httpx.post(f"{reward.base_url}/classify", json={"model": "tiny-reward", "input": "x"})
    assert vllm.status_code == 200 and vllm.json()["object"] == "list"


def test_bad_sglang_bodies_are_400_naming_the_field(reward: ServerProcess) -> None:
    both = httpx.post(f"{reward.base_url}/classify", json={"text": "a", "input_ids": [1]})
    assert both.status_code == 400 and both.json()["error"]["param"] == "text"
    image = httpx.post(f"{reward.base_url}/classify", json={"text": "a", "image_data": "x"})
    assert image.status_code == 400 and image.json()["error"]["param"] == "image_data"
    unknown = httpx.post(f"{reward.base_url}/classify", json={"text": "a", "colour": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "colour"
