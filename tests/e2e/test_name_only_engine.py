"""An engine whose model_name is not a local folder: the tokenizer comes from --tokenizer."""

from __future__ import annotations

from pathlib import Path

import httpx

from penstock.engines.samples.engine import SAMPLE_TOKENIZER_DIR
from tests.support.server import running_server

ENGINE = "tests.support.doubles:ScriptedEngine"
CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}


def test_without_a_tokenizer_only_token_prompts_work(tmp_path: Path) -> None:
    with running_server(["--engine", ENGINE], tmp_path) as server:
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", json=CHAT)
        assert chat.status_code == 400
        assert "--tokenizer" in chat.json()["error"]["message"]
        text = httpx.post(
            f"{server.base_url}/v1/completions", json={"model": "scripted", "prompt": "hi"}
        )
        assert text.status_code == 400 and "--tokenizer" in text.json()["error"]["message"]
        tokens = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "scripted", "prompt": [1, 2, 3], "return_token_ids": True},
        )
        assert tokens.status_code == 200
        assert tokens.json()["choices"][0]["token_ids"] == [5, 7]


def test_tokenizer_flag_enables_chat(tmp_path: Path) -> None:
    args = ["--engine", ENGINE, "--tokenizer", str(SAMPLE_TOKENIZER_DIR)]
    with running_server(args, tmp_path) as server:
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", json=CHAT)
        assert chat.status_code == 200
        assert chat.json()["choices"][0]["message"]["content"] != ""
