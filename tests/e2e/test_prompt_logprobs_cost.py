"""``prompt_logprobs`` of a long prompt through ``penstock serve --engine transformers``:
computed chunk by chunk beside the decoding rows (another stream keeps receiving tokens
while it is prefilled) and bounded (a request whose answer would hold too many logprobs
is refused)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from penstock.engines.transformers.core.prompt_logprobs import PROMPT_LOGPROB_CHUNK
from tests.support.server import ServerProcess, transformers_server
from tests.support.tiny import build_tokenizer
from tests.support.tiny_llm import save_sharpened, tiny_llama_config

# Many times the tokens one step computes of a prompt asking for its logprobs.
PROMPT_TOKENS = 2_400


def build_long_context_llama(folder: Path) -> Path:
    """The tests' tiny Llama with room for a few thousand tokens of context."""
    build_tokenizer(folder)
    config = tiny_llama_config(Tokenizer.from_file(str(folder / "tokenizer.json")))
    config.max_position_embeddings = 4_096
    torch.manual_seed(0)
    save_sharpened(LlamaForCausalLM(config), config, folder)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_long_context_llama(tmp_path_factory.mktemp("long-llama"))
    with transformers_server(model_dir, tmp_path_factory.mktemp("serve")) as process:
        yield process


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    draw = random.Random(seed)
    return [draw.randrange(10, 1_900) for _ in range(length)]


def model_id(server: ServerProcess) -> str:
    return str(httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"])


def complete(server: ServerProcess, body: dict[str, object]) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": model_id(server), "max_tokens": 1, **body},
        timeout=300,
    )


class StreamClock:
    """A stream decoding in the background: when each of its chunks arrived."""

    def __init__(self, server: ServerProcess) -> None:
        self.arrivals: list[float] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(server,), daemon=True)
        self.thread.start()

    def _read(self, server: ServerProcess) -> None:
        body = {
            "model": model_id(server),
            "prompt": "a",
            "max_tokens": 3_000,
            "ignore_eos": True,
            "stream": True,
        }
        url = f"{server.base_url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=300) as reply:
            for _ in reply.iter_lines():
                self.arrivals.append(time.monotonic())
                if self.stopped.is_set():
                    return

    def received(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.arrivals)


def test_a_long_prompt_with_prompt_logprobs_is_prefilled_beside_a_decoding_stream(
    server: ServerProcess,
) -> None:
    clock = StreamClock(server)
    try:
        while len(clock.arrivals) < 20:
            time.sleep(0.05)
        start = time.monotonic()
        reply = complete(server, {"prompt": prompt(2), "prompt_logprobs": 5})
        received = clock.received(start, time.monotonic())
        assert reply.status_code == 200, reply.text
        logprobs = reply.json()["choices"][0]["prompt_logprobs"]
        assert len(logprobs) == PROMPT_TOKENS and logprobs[0] is None
        assert all(len(position) >= 5 for position in logprobs[1:])
    finally:
        clock.stopped.set()
    # Each step computing a chunk of the prompt also decodes the stream; a prompt computed
    # whole would let through a token or two.
    assert received >= PROMPT_TOKENS // PROMPT_LOGPROB_CHUNK - 1, received


def test_prompt_logprobs_beyond_the_answer_bound_are_refused(server: ServerProcess) -> None:
    # 3,200 tokens x (1 + 20) logprobs: more than the 65,536 a request is answered.
    reply = complete(server, {"prompt": prompt(3, 3_200), "prompt_logprobs": 20})
    assert reply.status_code == 400, reply.text[:300]
    assert "65536" in reply.json()["error"]["message"]
    small = complete(server, {"prompt": prompt(3, 3_200), "prompt_logprobs": 0})
    assert small.status_code == 200, small.text
    assert len(small.json()["choices"][0]["prompt_logprobs"]) == 3_200
