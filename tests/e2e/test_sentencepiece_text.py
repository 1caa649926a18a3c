"""With a SentencePiece-style tokenizer the completion continues the prompt's text.

Such a tokenizer marks a word's leading space with ``▁`` and its decoder drops the space
of the first token it sees; the completion must still start with the space its first
token decodes to after the prompt, and ``echo`` must read as prompt and completion
decoded together.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from penstock.preprocess import Preprocessor
from tests.support.inprocess import asgi_client, start_gateway
from tests.support.tiny import build_sentencepiece_tokenizer

PROMPT = "the quick brown fox"


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    return build_sentencepiece_tokenizer(tmp_path / "sentencepiece")


@pytest.fixture
async def client(tokenizer_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    gateway = await start_gateway(engine_args=["--delay", "0", "--tokenizer", str(tokenizer_dir)])
    try:
        async for http in asgi_client(gateway):
            yield http
    finally:
        await gateway.host.cleanup()


def _body(**options: Any) -> dict[str, Any]:
    return {"model": "sample-model", "prompt": PROMPT, "max_tokens": 3, **options}


def _expected_text(tokenizer_dir: Path, completion_ids: list[int]) -> str:
    preprocessor = Preprocessor.from_folder(tokenizer_dir)
    return preprocessor.decode(preprocessor.encode(PROMPT) + completion_ids)


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[len("data: ") :]))
    return chunks


async def test_completion_text_keeps_the_space_before_its_first_word(
    client: httpx.AsyncClient,
) -> None:
    answer = (await client.post("/v1/completions", json=_body())).json()
    assert answer["choices"][0]["text"] == " hello world the"


async def test_echo_reads_as_prompt_and_completion_decoded_together(
    client: httpx.AsyncClient, tokenizer_dir: Path
) -> None:
    body = _body(echo=True, return_token_ids=True)
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["text"] == _expected_text(tokenizer_dir, choice["token_ids"])
    assert choice["text"] == "the quick brown fox hello world the"


async def test_streamed_echo_reads_as_prompt_and_completion_decoded_together(
    client: httpx.AsyncClient, tokenizer_dir: Path
) -> None:
    chunks = await _stream(client, _body(echo=True, stream=True, return_token_ids=True))
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    token_ids = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
    assert text == _expected_text(tokenizer_dir, token_ids)
    assert chunks[0]["choices"][0]["text"] == "the quick brown fox hello"


async def test_logprob_offsets_start_after_the_echo_streamed_or_not(
    client: httpx.AsyncClient,
) -> None:
    whole = (await client.post("/v1/completions", json=_body(echo=True, logprobs=0))).json()
    chunks = await _stream(client, _body(echo=True, logprobs=0, stream=True))
    streamed = [
        offset
        for chunk in chunks
        for offset in (chunk["choices"][0]["logprobs"] or {}).get("text_offset", [])
    ]
    assert streamed[0] == whole["choices"][0]["logprobs"]["text_offset"][0] == len(PROMPT)
