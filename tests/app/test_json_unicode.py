"""A body's strings are searched for unpaired surrogates once: by pydantic-core's JSON
parser, which refuses them, or, for a body only ``json`` reads, by the request models."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from penstock.schemas import unicode
from penstock.schemas.json_body import parse_json
from penstock.schemas.openai import ChatCompletionRequest
from penstock.schemas.unicode import UNICODE_CHECKED

CHAT = TypeAdapter(ChatCompletionRequest)


def wide_tool_body(text: str) -> dict[str, Any]:
    properties = {f"p{i}": {"type": "string", "description": text} for i in range(2_000)}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": properties}}}
    return {"messages": [{"role": "user", "content": text}], "tools": [tool]}


@pytest.fixture
def searched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    search = unicode._surrogate_in

    def counting(text: str) -> str | None:
        seen.append(text)
        return search(text)

    monkeypatch.setattr(unicode, "_surrogate_in", counting)
    return seen


def test_a_body_the_fast_parser_read_is_not_searched_again(searched: list[str]) -> None:
    value, checked = parse_json(json.dumps(wide_tool_body("déjà")).encode())
    assert checked
    context = UNICODE_CHECKED if checked else None
    request = CHAT.validate_python(value, from_attributes=True, context=context)
    assert request.tools is not None and searched == []


def test_a_lone_surrogate_escape_is_read_by_json_and_refused_naming_the_field(
    searched: list[str],
) -> None:
    value, checked = parse_json(json.dumps(wide_tool_body("\ud800")).encode())
    assert not checked
    with pytest.raises(ValidationError, match="unpaired surrogate U\\+D800") as raised:
        CHAT.validate_python(value, from_attributes=True, context=None)
    assert raised.value.errors()[0]["loc"][0] == "messages"
    assert searched
