"""The differences between vLLM's answer and Penstock's to one request.

What legitimately varies (ids, timestamps, fingerprints, versions) is left out; the rest is
compared: the status, the body's kind, every key path with its JSON types, an SSE stream's
framing, and for cases that compare values (greedy generations, the tokenizer) every value,
numbers within ``LOGPROB_TOLERANCE``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.conformance.sse import Stream, parse_stream

# Float32 logprobs from two implementations of the same model agree to about 1e-5.
LOGPROB_TOLERANCE = 1e-4
# Values that differ between any two answers, even from one server.
_VARYING_KEYS = frozenset(
    {"id", "created", "created_at", "system_fingerprint", "request_id", "version"}
)
# Objects whose keys are data (tokens, token ids), not field names.
_MAP_PATHS = (
    re.compile(r"logprobs\.top_logprobs\[\]$"),
    re.compile(r"prompt_logprobs\[\]$"),
    re.compile(r"(^|\.)metadata$"),
)


@dataclass(frozen=True)
class Difference:
    """One difference. ``kind``: status, body, type, missing (only vLLM has the path),
    extra (only Penstock has it), value or sse."""

    kind: str
    path: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.path or '<root>'}: {self.detail}"


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    text: str

    @property
    def media_type(self) -> str:
        return self.content_type.split(";")[0].strip().lower()

    def body_kind(self) -> str:
        if self.media_type == "text/event-stream":
            return "sse"
        if not self.text.strip():
            return "empty"
        try:
            json.loads(self.text)
        except ValueError:
            return "text"
        return "json"


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def key_paths(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every (path, JSON type) in ``value``; list items share the path ``[]``."""
    yield path, json_type(value)
    if isinstance(value, dict):
        is_map = any(pattern.search(path) for pattern in _MAP_PATHS)
        for key, item in value.items():
            name = "{key}" if is_map else key
            yield from key_paths(item, f"{path}.{name}" if path else name)
    elif isinstance(value, list):
        for item in value:
            yield from key_paths(item, f"{path}[]")


def structure_differences(vllm: Any, penstock: Any, prefix: str = "") -> list[Difference]:
    """Key paths and types; a path whose parent already differs is not repeated. A key
    one side leaves out and the other sends as null is the same to a client (OpenAI's
    clients read both as None)."""
    ours = _types_by_path(penstock, prefix)
    theirs = _types_by_path(vllm, prefix)
    found: list[Difference] = []
    for path in sorted(ours.keys() | theirs.keys()):
        if any(_is_under(path, earlier.path) for earlier in found):
            continue
        if ours.get(path, {"null"}) == {"null"} and theirs.get(path, {"null"}) == {"null"}:
            continue
        if path not in ours:
            found.append(Difference("missing", path, f"vLLM has {_types(theirs[path])}"))
        elif path not in theirs:
            found.append(Difference("extra", path, f"Penstock has {_types(ours[path])}"))
        elif ours[path] != theirs[path]:
            detail = f"vLLM {_types(theirs[path])}, Penstock {_types(ours[path])}"
            found.append(Difference("type", path, detail))
    return found


def _types_by_path(value: Any, prefix: str) -> dict[str, set[str]]:
    paths: dict[str, set[str]] = {}
    for path, kind in key_paths(value, prefix):
        paths.setdefault(path, set()).add(kind)
    return paths


def _types(kinds: set[str]) -> str:
    return "|".join(sorted(kinds))


def _is_under(path: str, ancestor: str) -> bool:
    if ancestor == "":
        return path != ""
    return path.startswith(ancestor) and path[len(ancestor) : len(ancestor) + 1] in (".", "[")


def value_differences(vllm: Any, penstock: Any, path: str = "") -> Iterator[Difference]:
    """Values at the paths both sides have with the same type (indices kept)."""
    if json_type(vllm) != json_type(penstock):
        return
    if isinstance(vllm, dict):
        if _is_map(path) and vllm.keys() != penstock.keys():
            detail = f"vLLM keys {sorted(vllm)}, Penstock keys {sorted(penstock)}"
            yield Difference("value", path, detail)
        for key in vllm.keys() & penstock.keys():
            if key not in _VARYING_KEYS:
                yield from value_differences(vllm[key], penstock[key], _join(path, key))
    elif isinstance(vllm, list):
        if len(vllm) != len(penstock):
            yield Difference("value", path, f"vLLM {len(vllm)} items, Penstock {len(penstock)}")
        for index, (theirs, ours) in enumerate(zip(vllm, penstock, strict=False)):
            yield from value_differences(theirs, ours, f"{path}[{index}]")
    elif not _same_value(vllm, penstock):
        yield Difference("value", path, f"vLLM {vllm!r}, Penstock {penstock!r}")


def _is_map(path: str) -> bool:
    generic = re.sub(r"\[\d+\]", "[]", path)
    return any(pattern.search(generic) for pattern in _MAP_PATHS)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _same_value(vllm: Any, penstock: Any) -> bool:
    if isinstance(vllm, float) or isinstance(penstock, float):
        if isinstance(vllm, bool) or isinstance(penstock, bool):
            return vllm == penstock
        return math.isclose(vllm, penstock, rel_tol=0, abs_tol=LOGPROB_TOLERANCE)
    return vllm == penstock


def answer_differences(vllm: Answer, penstock: Answer, *, values: bool) -> list[Difference]:
    """Everything that differs between the two answers to one request."""
    if vllm.status != penstock.status:
        detail = f"vLLM {vllm.status}, Penstock {penstock.status}: {penstock.text[:300]!r}"
        return [Difference("status", "", detail)]
    if vllm.body_kind() != penstock.body_kind():
        detail = (
            f"vLLM {vllm.body_kind()} {vllm.text[:120]!r}, "
            f"Penstock {penstock.body_kind()} {penstock.text[:120]!r}"
        )
        return [Difference("body", "", detail)]
    if vllm.body_kind() == "sse":
        return stream_differences(parse_stream(vllm.text), parse_stream(penstock.text), values)
    if vllm.body_kind() != "json":
        return []
    theirs, ours = json.loads(vllm.text), json.loads(penstock.text)
    found = structure_differences(theirs, ours)
    # Error messages are prose; only their shape is compared.
    if values and vllm.status < 400:
        found.extend(value_differences(theirs, ours))
    return found


def stream_differences(vllm: Stream, penstock: Stream, values: bool) -> list[Difference]:
    """SSE framing (fields, event names, the ``[DONE]`` end, what each run of chunks
    carries), the union of the chunks' key paths, and for greedy streams the assembled
    texts and the final usage."""
    found: list[Difference] = []
    for aspect in ("fields", "event_names", "ends_with_done", "pattern"):
        theirs, ours = getattr(vllm, aspect), getattr(penstock, aspect)
        if theirs != ours:
            found.append(Difference("sse", aspect, f"vLLM {theirs}, Penstock {ours}"))
    found.extend(structure_differences(vllm.chunks, penstock.chunks, "chunks"))
    if values:
        found.extend(value_differences(vllm.assembled(), penstock.assembled(), "assembled"))
    return found
