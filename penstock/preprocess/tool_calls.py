"""Tool calls in generated text, in the formats models are trained to write them.

Each format (``--tool-call-parser``, named as vLLM names them) says where the calls begin
and how the text from there on reads as calls:

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, anywhere after the content;
- ``llama3_json`` (Llama 3.1-3.3): the answer opens with ``{"name": ..., "parameters": {...}}``
  (or ``"arguments"``), optionally after ``<|python_tag|>``, several joined by ``;``;
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}``
  (tokenizers before v11), or ``[TOOL_CALLS]name{...}`` once per call (v11 on); call ids are
  nine letters and digits, as Mistral's chat templates require;
- ``pythonic`` (Llama 3.2 and 4, ToolACE): the answer is a Python list of calls with keyword
  arguments of literal values, ``[get_weather(city="Paris"), ...]``;
- ``qwen3_coder`` (also ``qwen3_xml``; Qwen3-Coder):
  ``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``, each
  value read as the type the tool's parameter schema declares.

While streaming, everything from where the calls begin is held back (and a tail that may
be the start of a marker) and read when the choice finishes; text that does not read as
calls is released as text, so nothing the model wrote is lost. The whole-text split is the
same stream fed at once, so a stream and a non-stream answer always agree.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# A tool's name to its parameters' JSON schemas (``parameters.properties``).
ToolSchemas = Mapping[str, Mapping[str, Any]]


def _openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_MISTRAL_ID_ALPHABET = string.ascii_letters + string.digits


def _mistral_call_id() -> str:
    return "".join(secrets.choice(_MISTRAL_ID_ALPHABET) for _ in range(9))


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=_openai_call_id)

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
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


# Reads the text from where the calls begin; None when it is not calls.
CallReader = Callable[[str, ToolSchemas], list[ParsedToolCall] | None]


@dataclass(frozen=True)
class ToolCallFormat:
    """Where a format's calls begin (``markers``) and how they read (``read``).

    ``leading``: the calls must open the answer (after whitespace), else the answer is text.
    """

    markers: tuple[str, ...]
    read: CallReader
    leading: bool = False


def _arguments_json(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _named_call(
    payload: Any, *keys: str, make_id: Callable[[], str] = _openai_call_id
) -> ParsedToolCall | None:
    """``{"name": ..., <first of keys>: {...}}`` as a call; None when it is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = next((payload[key] for key in keys if key in payload), {})
    encoded = _arguments_json(arguments)
    if encoded is None:
        return None
    return ParsedToolCall(payload["name"], encoded, make_id())


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _read_hermes(text: str, tools: ToolSchemas) -> list[ParsedToolCall] | None:
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            call = _named_call(json.loads(block), "arguments")
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    if _HERMES_BLOCK.sub("", text).strip():
        return None
    return calls


_PYTHON_TAG = "<|python_tag|>"
_JSON = json.JSONDecoder()


def _read_llama3_json(text: str, tools: ToolSchemas) -> list[ParsedToolCall] | None:
    text = text.strip().removeprefix(_PYTHON_TAG)
    calls = []
    position = 0
    while True:
        position = _skip_space(text, position)
        if position == len(text):
            return calls
        try:
            payload, position = _JSON.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        call = _named_call(payload, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)
        position = _skip_space(text, position)
        if text.startswith(";", position):
            position += 1


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


_MISTRAL_MARKER = "[TOOL_CALLS]"


def _read_mistral(text: str, tools: ToolSchemas) -> list[ParsedToolCall] | None:
    pieces = [piece.strip() for piece in text.split(_MISTRAL_MARKER)[1:]]
    if len(pieces) == 1 and pieces[0].startswith("["):
        try:
            payloads = json.loads(pieces[0])
        except json.JSONDecodeError:
            return None
        if not isinstance(payloads, list):
            return None
        listed = [_named_call(p, "arguments", make_id=_mistral_call_id) for p in payloads]
        return None if None in listed else [call for call in listed if call is not None]
    calls = []
    for piece in pieces:
        brace = piece.find("{")
        if brace <= 0:
            return None
        try:
            arguments, end = _JSON.raw_decode(piece, brace)
        except json.JSONDecodeError:
            return None
        encoded = _arguments_json(arguments)
        if encoded is None or piece[end:].strip():
            return None
        calls.append(ParsedToolCall(piece[:brace].strip(), encoded, _mistral_call_id()))
    return calls


def _read_pythonic(text: str, tools: ToolSchemas) -> list[ParsedToolCall] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            encoded = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError):
            return None
        if None in arguments:
            return None
        calls.append(ParsedToolCall(node.func.id, encoded))
    return calls


_XML_CALL = re.compile(
    r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL
)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _read_qwen3_xml(text: str, tools: ToolSchemas) -> list[ParsedToolCall] | None:
    if _XML_CALL.sub("", text).strip():
        return None
    calls = []
    for name, body in _XML_CALL.findall(text):
        if _XML_PARAMETER.sub("", body).strip():
            return None
        schemas = tools.get(name, {})
        arguments = {}
        for parameter, raw in _XML_PARAMETER.findall(body):
            arguments[parameter] = _typed_value(_unwrapped(raw), schemas.get(parameter))
        calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _unwrapped(raw: str) -> str:
    """A parameter's text without the one whitespace character that may wrap it on each
    side (the newlines Qwen3-Coder writes; what a constrained call may write instead)."""
    if raw[:1].isspace():
        raw = raw[1:]
    if raw[-1:].isspace():
        raw = raw[:-1]
    return raw


def _typed_value(value: str, schema: Any) -> Any:
    """An XML parameter's text as the JSON value its schema's ``type`` declares.

    A value that does not read as that type stays the model's text, for the caller's
    validation to report, rather than becoming something the model did not write.
    """
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError:
        return value
    for name in kind if isinstance(kind, list) else [kind]:
        if name not in _JSON_TYPES:
            return decoded
        if _is_json_type(decoded, name):
            return decoded
    return value


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
    "null": type(None),
}


def _is_json_type(value: Any, name: str) -> bool:
    # ``True`` is an ``int`` to Python, never an integer to JSON Schema.
    if isinstance(value, bool):
        return name == "boolean"
    return isinstance(value, _JSON_TYPES[name])


_XML_FORMAT = ToolCallFormat(("<tool_call>",), _read_qwen3_xml)

TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(("<tool_call>",), _read_hermes),
    "llama3_json": ToolCallFormat((_PYTHON_TAG, "{"), _read_llama3_json, leading=True),
    "mistral": ToolCallFormat((_MISTRAL_MARKER,), _read_mistral),
    "pythonic": ToolCallFormat(("[",), _read_pythonic, leading=True),
    "qwen3_coder": _XML_FORMAT,
    "qwen3_xml": _XML_FORMAT,
}

TOOL_CALL_PARSERS = tuple(TOOL_CALL_FORMATS)


def tool_schemas(tools: Sequence[Any] | None) -> dict[str, Mapping[str, Any]]:
    """The request's function tools as :data:`ToolSchemas` (objects with a ``function``)."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        parameters = tool.function.parameters or {}
        properties = parameters.get("properties")
        schemas[tool.function.name] = properties if isinstance(properties, dict) else {}
    return schemas


class ToolCallStream:
    """One choice's text: content passes on, the calls are held back and read at the end.

    ``parallel``: False keeps only the first call, as ``parallel_tool_calls: false`` asks.
    """

    __slots__ = ("_format", "_held", "_in_call", "_parallel", "_plain", "_tools")

    def __init__(
        self, format: ToolCallFormat, tools: ToolSchemas | None = None, *, parallel: bool = True
    ) -> None:
        self._format = format
        self._tools: ToolSchemas = tools or {}
        self._parallel = parallel
        self._held = ""
        self._in_call = False
        # A leading format whose answer opened with text: nothing more to look for.
        self._plain = False

    def feed(self, text: str) -> str:
        """The part of ``text`` that is content for sure; the rest is held."""
        if self._in_call:
            self._held += text
            return ""
        if self._plain:
            return text
        combined = self._held + text
        start, keep = (_leading_start if self._format.leading else _first_start)(
            combined, self._format.markers
        )
        if start is not None:
            self._in_call = True
            self._held = combined[start:]
            return combined[:start]
        if keep is None:
            self._plain = True
            self._held = ""
            return combined
        self._held = combined[len(combined) - keep :] if keep else ""
        return combined[: len(combined) - keep]

    def finish(self) -> ToolCallSplit:
        """At the end of the choice: the text still to emit and the calls read."""
        held, self._held = self._held, ""
        if not self._in_call:
            return ToolCallSplit(held, [])
        calls = self._format.read(held, self._tools)
        if not calls:
            return ToolCallSplit(held, [])
        return ToolCallSplit("", calls if self._parallel else calls[:1])


def split_tool_calls(
    format: ToolCallFormat, text: str, tools: ToolSchemas | None = None, *, parallel: bool = True
) -> ToolCallSplit:
    """The whole text's content and calls: what a stream of it ends with."""
    stream = ToolCallStream(format, tools, parallel=parallel)
    content = stream.feed(text)
    rest, calls = stream.finish()
    return ToolCallSplit(content + rest, calls)


def _first_start(text: str, markers: tuple[str, ...]) -> tuple[int | None, int]:
    """Where the first marker begins, else how long a tail may still begin one."""
    found = [index for index in (text.find(marker) for marker in markers) if index >= 0]
    if found:
        return min(found), 0
    return None, max(partial_marker_length(text, marker) for marker in markers)


def _leading_start(text: str, markers: tuple[str, ...]) -> tuple[int | None, int | None]:
    """Where the answer's opening marker begins; else the length to hold while it may
    still open with one, or None once the answer opened with anything else."""
    opening = text.lstrip()
    if any(opening.startswith(marker) for marker in markers):
        return len(text) - len(opening), 0
    if not opening or any(marker.startswith(opening) for marker in markers):
        return None, len(text)
    return None, None


def partial_marker_length(text: str, marker: str) -> int:
    """How long the longest end of ``text`` is that ``marker`` begins with (not all of it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
