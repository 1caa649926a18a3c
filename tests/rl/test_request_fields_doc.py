"""The "Request fields" table of ``docs/rl-trainers.md`` against the request models: each
row's refused fields are exactly those its model refuses, and each honoured field is one
the model declares and does not refuse."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from penstock.routers.tokenize import TOKENIZE_UNSUPPORTED, TokenizeRequest
from penstock.schemas.openai import (
    VLLM_UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from penstock.serving.generate import (
    GENERATE_UNSUPPORTED,
    SAMPLING_UNSUPPORTED,
    GenerateBody,
    SamplingParams,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "rl-trainers.md"
# A field name at the start of a backticked span: `name` or `name: value`.
NAME = re.compile(r"`([a-z_]+)[`:]")


def table_row(dialect: str) -> tuple[str, str]:
    """The honoured and refused cells of the row whose first cell starts with ``dialect``."""
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) == 5 and cells[1].startswith(dialect):
            return cells[2], cells[3]
    raise AssertionError(f"no row for {dialect}")


def names(cell: str) -> set[str]:
    # Parenthesised remarks quote values (`auto`), not fields.
    return set(NAME.findall(re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", cell)))


def declared(*models: type[BaseModel]) -> set[str]:
    return {name for model in models for name in model.model_fields}


@pytest.mark.parametrize(
    ("dialect", "models", "refused"),
    [
        ("SGLang `SamplingParams`", (SamplingParams,), SAMPLING_UNSUPPORTED),
        ("SGLang `GenerateReqInput`", (GenerateBody,), GENERATE_UNSUPPORTED),
        ("vLLM `TokenizeRequest`", (TokenizeRequest,), TOKENIZE_UNSUPPORTED),
    ],
)
def test_each_row_matches_its_model(
    dialect: str, models: tuple[type[BaseModel], ...], refused: dict[str, object]
) -> None:
    honoured_cell, refused_cell = table_row(dialect)
    assert names(refused_cell) == set(refused)
    honoured = names(honoured_cell)
    assert honoured <= declared(*models) - set(refused)


def test_the_vllm_extras_row_matches_chat_and_completions() -> None:
    honoured_cell, refused_cell = table_row("vLLM extras")
    shared, completions, chat = refused_cell.split("; ")
    assert names(shared) == set(VLLM_UNSUPPORTED)
    assert completions.startswith("completions ") and chat.startswith("chat ")
    assert names(completions) == set(CompletionRequest.unsupported) - set(VLLM_UNSUPPORTED)
    assert names(chat) == set(ChatCompletionRequest.unsupported) - set(VLLM_UNSUPPORTED)
    fields = declared(SamplingFields, CompletionRequest, ChatCompletionRequest)
    assert names(honoured_cell) <= fields - set(VLLM_UNSUPPORTED)
    assert {"priority", "structured_outputs", "guided_regex"} <= names(honoured_cell)
