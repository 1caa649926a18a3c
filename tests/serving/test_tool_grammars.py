"""The grammar of forced calls in each format: it takes exactly the calls its parser reads
with valid arguments (one, or several with parallel calls), and nothing else."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from penstock.errors import InvalidRequestError
from penstock.preprocess.tool_calls import TOOL_CALL_FORMATS, TOOL_CALL_PARSERS, split_tool_calls
from penstock.preprocess.tool_calls import tool_schemas as schemas_of
from penstock.schemas.openai import ChatCompletionRequest, Tool
from penstock.serving.guided import tool_call_constraint
from penstock.serving.tool_grammars import CALL_FORMATS, forced_calls_tag

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "alert": {"type": ["boolean", "null"]},
    },
    "required": ["city", "days"],
}
TOOLS = [
    Tool.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    )
]

# Per format: one call, a second call after it, and the first with days out of range.
CALLS: dict[str, tuple[str, str, str]] = {
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "\n</tool_call>",
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1, '
        '"alert": true}}\n</tool_call>',
        '"days": 9',
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        '; {"name": "get_weather", "parameters": {"city": "Oslo", "days": 1, "alert": true}}',
        '"days": 9',
    ),
    "pythonic": (
        '[get_weather(city="Paris", days=2)]',
        ', get_weather(city="Oslo", days=1, alert=True)]',
        "days=9",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n1\n</parameter>\n<parameter=alert>\ntrue\n</parameter>\n"
        "</function>\n</tool_call>",
        "\n9\n",
    ),
}
MISTRAL_ONE = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'
MISTRAL_TWO = (
    MISTRAL_ONE[:-1] + ', {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]'
)


def _grammar(parser: str, *, parallel: bool) -> Any:
    return xgrammar.Grammar.from_structural_tag(
        json.dumps(forced_calls_tag(parser, TOOLS, parallel=parallel))
    )


def _read_valid(parser: str, text: str) -> int:
    """How many calls ``parser`` reads in ``text``, each checked against its schema."""
    split = split_tool_calls(TOOL_CALL_FORMATS[parser], text, schemas_of(TOOLS))
    assert split.content == ""
    for call in split.calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    return len(split.calls)


def _two_calls(parser: str) -> tuple[str, str]:
    if parser == "mistral":
        return MISTRAL_ONE, MISTRAL_TWO
    one, second, _ = CALLS[parser]
    two = one[:-1] + second if parser == "pythonic" else one + second
    return one, two


def test_every_parser_has_a_call_grammar() -> None:
    assert set(CALL_FORMATS) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize("parser", [*CALLS, "mistral"])
def test_one_call_always_and_more_only_in_parallel(parser: str) -> None:
    one, two = _two_calls(parser)
    single, parallel = _grammar(parser, parallel=False), _grammar(parser, parallel=True)
    assert _is_grammar_accept_string(single, one)
    assert _is_grammar_accept_string(parallel, one)
    assert not _is_grammar_accept_string(single, two)
    assert _is_grammar_accept_string(parallel, two)
    assert not _is_grammar_accept_string(parallel, "")
    assert _read_valid(parser, one) == 1
    assert _read_valid(parser, two) == 2


@pytest.mark.parametrize("parser", list(CALLS))
def test_arguments_outside_the_schema_are_refused(parser: str) -> None:
    one, _, wrong_days = CALLS[parser]
    right_days = {"pythonic": "days=2", "qwen3_coder": "\n2\n"}.get(parser, '"days": 2')
    assert not _is_grammar_accept_string(
        _grammar(parser, parallel=True), one.replace(right_days, wrong_days)
    )


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ('[get_weather(city="Paris", days=2, alert=None)]', True),
        ('[get_weather(city="Paris", days=2, alert=true)]', False),
        ('[get_weather(days=2, city="Paris")]', False),
        ('[get_weather(city="Paris")]', False),
        ('[get_weather(city="Paris", days=2, wind=3)]', False),
    ],
)
def test_pythonic_arguments_are_python_literals_in_the_schema_order(
    text: str, accepted: bool
) -> None:
    assert _is_grammar_accept_string(_grammar("pythonic", parallel=False), text) is accepted


def test_pythonic_strings_hold_no_escape_python_reads_otherwise() -> None:
    free_text = {"type": "object", "properties": {"note": {"type": "string"}}}
    tools = [
        Tool.model_validate(
            {"type": "function", "function": {"name": "say", "parameters": free_text}}
        )
    ]
    grammar = xgrammar.Grammar.from_structural_tag(
        json.dumps(forced_calls_tag("pythonic", tools, parallel=False))
    )
    assert _is_grammar_accept_string(grammar, r'[say(note="a\"b\n\u00e9")]')
    assert not _is_grammar_accept_string(grammar, r'[say(note="a\/b")]')
    assert not _is_grammar_accept_string(grammar, r'[say(note="\ud83d\ude00")]')


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("get-weather", WEATHER),
        ("get_weather", {"type": "object", "properties": {"from": {"type": "string"}}}),
        ("get_weather", {"anyOf": [WEATHER]}),
    ],
)
def test_a_tool_python_cannot_call_is_a_400_naming_tools(
    name: str, parameters: dict[str, Any]
) -> None:
    tool = Tool.model_validate(
        {"type": "function", "function": {"name": name, "parameters": parameters}}
    )
    with pytest.raises(InvalidRequestError) as refused:
        forced_calls_tag("pythonic", [tool], parallel=False)
    assert refused.value.param == "tools"


@pytest.mark.parametrize(
    ("written", "read"),
    [
        ("\nParis\n", "Paris"),
        (" Paris\t", "Paris"),
        ("\n\nParis \n", "\nParis "),
        ("Paris", "Paris"),
    ],
)
def test_a_qwen_xml_string_loses_the_whitespace_the_grammar_may_wrap_it_in(
    written: str, read: str
) -> None:
    text = (
        f"<tool_call>\n<function=get_weather>\n<parameter=city>{written}</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = split_tool_calls(TOOL_CALL_FORMATS["qwen3_coder"], text, schemas_of(TOOLS)).calls
    assert json.loads(call.arguments) == {"city": read, "days": 2}


def test_forced_calls_need_a_tool_call_parser() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [TOOLS[0].model_dump()],
            "tool_choice": "required",
        }
    )
    with pytest.raises(InvalidRequestError) as refused:
        tool_call_constraint(body, None)
    assert refused.value.param == "tool_choice"
    assert "--tool-call-parser" in str(refused.value)
