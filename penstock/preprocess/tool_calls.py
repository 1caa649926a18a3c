"""Tool calls in generated text, for models that write them as tagged JSON.

``hermes`` (Hermes, Qwen2.5/Qwen3 and others): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Text before the first tag is
ordinary content. While streaming, everything from the first tag on is held back and
turned into ``tool_calls`` when the choice finishes; a block that does not parse is
released as text, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_START = "<tool_call>"

TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


class ToolCallSplit(NamedTuple):
    """Text split into what is shown as content and the calls it held."""

    content: str
    calls: list[ParsedToolCall]


def parse_hermes(text: str) -> ToolCallSplit | None:
    """Split ``text`` into content and calls; None when it holds no well-formed call."""
    start = text.find(_HERMES_START)
    if start < 0:
        return None
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        try:
            payload = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ParsedToolCall(payload["name"], arguments))
    rest = _HERMES_BLOCK.sub("", text[start:]).strip()
    if not calls or rest:
        return None
    return ToolCallSplit(text[:start], calls)


class ToolCallStream:
    """Holds back streamed text from the first ``<tool_call>`` (or a possible start of it)."""

    __slots__ = ("_held", "_in_call")

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> str:
        if self._in_call:
            self._held += text
            return ""
        combined = self._held + text
        start = combined.find(_HERMES_START)
        if start >= 0:
            self._in_call = True
            self._held = combined[start:]
            return combined[:start]
        keep = _partial_tag_length(combined)
        self._held = combined[len(combined) - keep :] if keep else ""
        return combined[: len(combined) - keep]

    def finish(self) -> ToolCallSplit:
        """At the end of the choice: the text still to emit and the parsed calls."""
        held, self._held = self._held, ""
        if not self._in_call:
            return ToolCallSplit(held, [])
        parsed = parse_hermes(held)
        if parsed is None:
            return ToolCallSplit(held, [])
        return parsed


def _partial_tag_length(text: str) -> int:
    for length in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):
        if _HERMES_START.startswith(text[-length:]):
            return length
    return 0
