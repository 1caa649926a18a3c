"""The grammar of forced tool calls (``tool_choice`` ``required`` or naming a function), in
the exact format the server's ``--tool-call-parser`` reads, as an xgrammar structural tag.

Each call's arguments are held to its tool's parameter schema, so what the parser reads
always validates:

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks,
  one per line;
- ``llama3_json``: ``{"name": ..., "parameters": {...}}`` opening the answer, several
  joined by ``; ``;
- ``mistral``: ``[TOOL_CALLS]`` and a JSON list of ``{"name": ..., "arguments": {...}}``;
- ``pythonic``: ``[name(key=value, ...), ...]``, each value a Python literal (``True``,
  ``False``, ``None``; strings without the escapes JSON has and Python reads otherwise)
  that reads back as JSON valid against the parameter's schema; keyword arguments follow
  the schema's order;
- ``qwen3_coder`` / ``qwen3_xml``: ``<tool_call>\\n<function=name>`` with one
  ``<parameter=key>value</parameter>`` per argument, values written as xgrammar's Qwen XML
  style writes them (at most one whitespace character around each).

With ``parallel`` one or more calls may follow one another; without it, exactly one.
Whitespace inside JSON arguments is bounded to one character at a time: a weak model
given free whitespace pads until its token limit.
"""

from __future__ import annotations

import functools
import json
import keyword
import re
from collections.abc import Callable, Sequence
from typing import Any

from penstock import extras
from penstock.errors import InvalidRequestError
from penstock.schemas.openai import Tool

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
_JSON_CONTENT_WHITESPACE = 1

Format = dict[str, Any]


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or ANY_JSON_OBJECT


def _json_arguments(tool: Tool) -> Format:
    return {
        "type": "json_schema",
        "json_schema": _parameters(tool),
        "max_whitespace_cnt": _JSON_CONTENT_WHITESPACE,
    }


def _tags(
    tools: Sequence[Tool], begin: Callable[[str], str], content: Callable[[Tool], Format], end: str
) -> list[Format]:
    return [
        {"type": "tag", "begin": begin(tool.function.name), "content": content(tool), "end": end}
        for tool in tools
    ]


def _separated(tags: list[Format], separator: str, *, parallel: bool) -> Format:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def hermes_calls(tools: Sequence[Tool], *, parallel: bool) -> Format:
    def begin(name: str) -> str:
        return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '

    return _separated(
        _tags(tools, begin, _json_arguments, "}\n</tool_call>"), "\n", parallel=parallel
    )


def llama3_json_calls(tools: Sequence[Tool], *, parallel: bool) -> Format:
    def begin(name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "parameters": '

    return _separated(_tags(tools, begin, _json_arguments, "}"), "; ", parallel=parallel)


def mistral_calls(tools: Sequence[Tool], *, parallel: bool) -> Format:
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "arguments": _parameters(tool),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return {
        "type": "tag",
        "begin": "[TOOL_CALLS]",
        "content": {
            "type": "json_schema",
            "json_schema": calls,
            "max_whitespace_cnt": _JSON_CONTENT_WHITESPACE,
        },
        "end": "",
    }


def qwen3_xml_calls(tools: Sequence[Tool], *, parallel: bool) -> Format:
    def begin(name: str) -> str:
        return f"<tool_call>\n<function={name}>\n"

    def content(tool: Tool) -> Format:
        return {
            "type": "json_schema",
            "json_schema": _parameters(tool),
            "style": "qwen_xml",
            "max_whitespace_cnt": 1,
        }

    return _separated(
        _tags(tools, begin, content, "</function>\n</tool_call>"), "\n", parallel=parallel
    )


def pythonic_calls(tools: Sequence[Tool], *, parallel: bool) -> Format:
    for tool in tools:
        _check_python_name(tool.function.name, "the function name")
    tags = _tags(tools, lambda name: f"{name}(", _keyword_arguments, ")")
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "["},
            _separated(tags, ", ", parallel=parallel),
            {"type": "const_string", "value": "]"},
        ],
    }


def _check_python_name(name: str, what: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise InvalidRequestError(
            f"tool_choice: {what} {name!r} is not a Python identifier, so the pythonic "
            "call format cannot write it",
            param="tools",
        )


# Keywords that shape the object beyond its named properties, which keyword arguments
# cannot follow.
_COMBINING_KEYWORDS = frozenset({"anyOf", "oneOf", "allOf", "not", "if", "$ref"})


def _keyword_arguments(tool: Tool) -> Format:
    """``key=value, ...`` in the schema's order: every required key, any optional ones."""
    parameters = _parameters(tool)
    properties = parameters.get("properties") or {}
    combined = _COMBINING_KEYWORDS.intersection(parameters)
    if parameters.get("type", "object") != "object" or not isinstance(properties, dict) or combined:
        raise InvalidRequestError(
            f"tool_choice: the parameters of {tool.function.name!r} are not an object of "
            "named properties, which the pythonic call format needs",
            param="tools",
        )
    required = set(parameters.get("required") or ())
    definitions = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    arguments: list[tuple[Format, bool]] = []
    for name, schema in properties.items():
        _check_python_name(name, "the parameter name")
        value = _python_literal(json.dumps({**schema, **definitions}, sort_keys=True))
        pair = {"type": "sequence", "elements": [_const(f"{name}="), value]}
        arguments.append((pair, name in required))
    return _first_argument(arguments)


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def _first_argument(arguments: list[tuple[Format, bool]]) -> Format:
    """The arguments from here on, none written yet (so none needs a leading comma)."""
    if not arguments:
        return _const("")
    (pair, required), rest = arguments[0], arguments[1:]
    written = {"type": "sequence", "elements": [pair, _later_arguments(rest)]}
    if required:
        return written
    return {"type": "or", "elements": [written, _first_argument(rest)]}


def _later_arguments(arguments: list[tuple[Format, bool]]) -> Format:
    """The arguments from here on, after one was written: each with its comma."""
    if not arguments:
        return _const("")
    elements: list[Format] = []
    for pair, required in arguments:
        item = {"type": "sequence", "elements": [_const(", "), pair]}
        elements.append(item if required else {"type": "optional", "content": item})
    return {"type": "sequence", "elements": elements}


# The literals JSON and Python spell differently, as xgrammar's EBNF quotes them.
_JSON_LITERALS = re.compile(r'(?<![\\\w])"(true|false|null)"(?![\w"])')
_PYTHON_LITERALS = {"true": '"True"', "false": '"False"', "null": '"None"'}
# JSON escapes Python reads differently: ``\/`` stays two characters, and a ``\u`` escape
# of a surrogate half is one of a pair in JSON but a lone surrogate in Python.
_JSON_ESCAPES = '[\\"\\\\/bfnrt]'
_PYTHON_ESCAPES = '[\\"\\\\bfnrt]'
_JSON_UNICODE_ESCAPE = '"u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]'
_PYTHON_UNICODE_ESCAPE = '"u" ([0-9A-Ca-cE-Fe-f] [A-Fa-f0-9] | [Dd] [0-7]) [A-Fa-f0-9] [A-Fa-f0-9]'


@functools.lru_cache(maxsize=256)
def _python_literal(schema_text: str) -> Format:
    """A grammar of the Python literals that read back as JSON valid against the schema:
    xgrammar's compact JSON grammar of it, respelled where Python differs."""
    xgrammar = extras.xgrammar()

    try:
        grammar = xgrammar.Grammar.from_json_schema(
            schema_text, any_whitespace=False, strict_mode=True
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError(
            f"tool_choice: a parameter schema cannot be constrained: {reason}", param="tools"
        ) from exc
    ebnf = _JSON_LITERALS.sub(lambda match: _PYTHON_LITERALS[match.group(1)], str(grammar))
    ebnf = ebnf.replace(_JSON_ESCAPES, _PYTHON_ESCAPES)
    ebnf = ebnf.replace(_JSON_UNICODE_ESCAPE, _PYTHON_UNICODE_ESCAPE)
    return {"type": "grammar", "grammar": ebnf}


CALL_FORMATS: dict[str, Callable[..., Format]] = {
    "hermes": hermes_calls,
    "llama3_json": llama3_json_calls,
    "mistral": mistral_calls,
    "pythonic": pythonic_calls,
    "qwen3_coder": qwen3_xml_calls,
    "qwen3_xml": qwen3_xml_calls,
}


def forced_calls_tag(parser: str, tools: Sequence[Tool], *, parallel: bool) -> dict[str, Any]:
    """xgrammar's structural tag of calls to ``tools`` in ``parser``'s format and nothing
    else: one, or with ``parallel`` one or more."""
    return {"type": "structural_tag", "format": CALL_FORMATS[parser](tools, parallel=parallel)}
