"""The parsers an engine declares in its ``WorkerConfig`` are used unless the flags name
others, as Dynamo's frontend uses ``--dyn-tool-call-parser`` and ``--dyn-reasoning-parser``."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.e2e.test_reasoning import MESSAGES, TOOLS
from tests.support.server import running_server

THOUGHT = "Paris is rainy."
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
REPLY = f"{THOUGHT}</think>On it. {CALL}"
DECLARED = ["--dyn-reasoning-parser", "deepseek_r1", "--dyn-tool-call-parser", "hermes"]


def _answer(tmp_path: Any, *gateway_flags: str) -> Any:
    flags = ["--engine", "tests.support.doubles:ReplyEngine", *gateway_flags]
    flags += ["--", "--reply", REPLY, *DECLARED]
    with running_server(flags, tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        completion = client.chat.completions.create(
            model="sample-model", messages=MESSAGES, tools=TOOLS
        )
    return completion.choices[0]


def test_the_engines_declared_parsers_split_the_answer(tmp_path: Any) -> None:
    choice = _answer(tmp_path)
    message = choice.message.model_dump()
    assert message["reasoning_content"] == THOUGHT
    assert message["content"] == "On it. "
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("flags", "content"),
    [
        # qwen3 reads reasoning only from an opening <think>: none here.
        (("--reasoning-parser", "qwen3"), f"{THOUGHT}</think>On it. "),
        # llama3_json reads calls only at the answer's start: the text stays content.
        (("--tool-call-parser", "llama3_json"), f"On it. {CALL}"),
    ],
)
def test_the_flags_win_over_what_the_engine_declares(
    tmp_path: Any, flags: tuple[str, ...], content: str
) -> None:
    message = _answer(tmp_path, *flags).message
    assert message.content == content
