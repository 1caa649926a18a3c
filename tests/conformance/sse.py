"""A server-sent event stream read for comparison: its framing and its JSON chunks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stream:
    fields: list[str] = field(default_factory=list)
    """The field names of the events' lines, in order of first use."""
    event_names: list[str] = field(default_factory=list)
    """``event:`` names, consecutive repeats collapsed."""
    ends_with_done: bool = False
    pattern: dict[str, list[str]] = field(default_factory=dict)
    """Per choice, what each run of its chunks carries (role, text, finish, usage...),
    repeats collapsed."""
    chunks: list[Any] = field(default_factory=list)

    def assembled(self) -> dict[str, Any]:
        """Per choice: the concatenated text, its finish reason and logprobs; the last
        usage; a Responses stream's final response."""
        choices: dict[int, dict[str, Any]] = {}
        assembled: dict[str, Any] = {"choices": choices}
        for chunk in self.chunks:
            if not isinstance(chunk, dict):
                continue
            if chunk.get("usage") is not None:
                assembled["usage"] = chunk["usage"]
            if chunk.get("type") == "response.completed":
                assembled["response"] = chunk.get("response")
            for choice in chunk.get("choices") or []:
                _add_choice_chunk(choices.setdefault(choice.get("index", 0), {}), choice)
        return assembled


def _add_choice_chunk(into: dict[str, Any], choice: dict[str, Any]) -> None:
    delta = choice.get("delta") or {}
    text = choice.get("text") or delta.get("content") or ""
    into["text"] = into.get("text", "") + text
    if delta.get("tool_calls"):
        into.setdefault("tool_calls", []).extend(delta["tool_calls"])
    if choice.get("finish_reason") is not None:
        into["finish_reason"] = choice["finish_reason"]
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        gathered = into.setdefault("logprobs", {})
        for key, items in logprobs.items():
            if isinstance(items, list):
                gathered.setdefault(key, []).extend(items)


def _choice_features(choice: dict[str, Any]) -> list[str]:
    delta = choice.get("delta") or {}
    features = []
    if "role" in delta:
        features.append("role")
    if choice.get("text") or delta.get("content"):
        features.append("text")
    if delta.get("tool_calls"):
        features.append("tool_calls")
    if choice.get("logprobs") is not None:
        features.append("logprobs")
    if choice.get("finish_reason") is not None:
        features.append("finish")
    return features


def _chunk_features(chunk: Any) -> list[str]:
    if not isinstance(chunk, dict):
        return ["not-an-object"]
    features = []
    if chunk.get("usage") is not None:
        features.append("usage")
    if "error" in chunk:
        features.append("error")
    return features


def _add_to_pattern(patterns: dict[str, list[str]], chunk: Any) -> None:
    """What ``chunk`` carries, under each choice it speaks for ("stream" for a chunk of no
    choice, a Responses event's type). A chunk that carries nothing changes nothing for a
    client and is left out (vLLM sends an empty delta while it holds back a stop string)."""
    if isinstance(chunk, dict) and "type" in chunk and "choices" not in chunk:
        _collapse(patterns.setdefault("stream", []), str(chunk["type"]))
        return
    shared = _chunk_features(chunk)
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        if shared:
            _collapse(patterns.setdefault("stream", []), "+".join(shared))
        return
    for choice in choices:
        features = "+".join(sorted({*_choice_features(choice), *shared}))
        if features:
            key = f"choice {choice.get('index', 0)}"
            _collapse(patterns.setdefault(key, []), features)


def _collapse(items: list[str], item: str) -> None:
    if not items or items[-1] != item:
        items.append(item)


def parse_stream(text: str) -> Stream:
    stream = Stream()
    for event in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in event.split("\n") if line]
        for line in lines:
            name, _, value = line.partition(":")
            if (name or "comment") not in stream.fields:
                stream.fields.append(name or "comment")
            if name == "event":
                _collapse(stream.event_names, value.strip())
        data = "\n".join(
            line.partition(":")[2].removeprefix(" ") for line in lines if line.startswith("data:")
        )
        if not data:
            continue
        stream.ends_with_done = data == "[DONE]"
        if stream.ends_with_done:
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = data
        stream.chunks.append(chunk)
        _add_to_pattern(stream.pattern, chunk)
    return stream
