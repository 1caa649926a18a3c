"""What a chat request's answer is split into besides content: reasoning, tool calls.

:func:`output_parsing` reads the request (``tools``, ``tool_choice``,
``parallel_tool_calls``, ``chat_template_kwargs.enable_thinking``) and the served model's
parsers once; each choice then gets its own :class:`ChoiceParser`. The reasoning is split
off first, so a call the model only thinks about is never a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from penstock.errors import InvalidRequestError
from penstock.preprocess.reasoning import ReasoningStream, opens_in_reasoning
from penstock.preprocess.tool_calls import (
    TOOL_CALL_FORMATS,
    ParsedToolCall,
    ToolCallFormat,
    ToolCallStream,
    ToolSchemas,
    tool_schemas,
)

if TYPE_CHECKING:
    from penstock.preprocess import Preprocessor
    from penstock.schemas.openai import ChatCompletionRequest

# Enough of the prompt's end to see a template's ``<think>`` in any tokenizer.
_PROMPT_TAIL_TOKENS = 8


class ParsedChunk(NamedTuple):
    reasoning: str
    content: str
    # Only once the choice has finished, and only when it held calls.
    calls: tuple[ParsedToolCall, ...]


@dataclass(frozen=True)
class OutputParsing:
    """One request's parsers: a tool-call format (with the request's tools) and whether
    reasoning is split off, and how it opens."""

    tool_format: ToolCallFormat | None
    tools: ToolSchemas
    parallel_tool_calls: bool
    reasoning_opened: bool | None
    # A streamed forced tool choice (``required`` or a named function): its grammar allows
    # only calls, so none of its text is content, and a call cut short by max_tokens
    # streams no text, as in vLLM. Not streamed, such a cut call stays the message's
    # content, as vLLM returns it.
    calls_only: bool = False

    def for_choice(self) -> ChoiceParser:
        return ChoiceParser(self)


class ChoiceParser:
    """One choice's reasoning and tool-call streams, fed its text in order."""

    __slots__ = ("_calls_only", "_reasoning", "_tools")

    def __init__(self, parsing: OutputParsing) -> None:
        opened = parsing.reasoning_opened
        self._reasoning = ReasoningStream(opened=opened) if opened is not None else None
        self._tools = (
            ToolCallStream(parsing.tool_format, parsing.tools, parallel=parsing.parallel_tool_calls)
            if parsing.tool_format is not None
            else None
        )
        self._calls_only = parsing.calls_only and self._tools is not None

    def feed(self, text: str, finished: bool) -> ParsedChunk:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text)
            if finished:
                more_reasoning, more_text = self._reasoning.finish()
                reasoning += more_reasoning
                text += more_text
        calls: tuple[ParsedToolCall, ...] = ()
        if self._tools is not None:
            text = self._tools.feed(text)
            if finished:
                rest, found = self._tools.finish()
                text += rest
                calls = tuple(found)
            if self._calls_only:
                text = ""
        return ParsedChunk(reasoning, text, calls)


def output_parsing(
    body: ChatCompletionRequest,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    preprocessor: Preprocessor | None,
    prompt_token_ids: list[int],
) -> OutputParsing | None:
    """The request's parsers; None when its answer is all content."""
    if tool_call_parser is None and reasoning_parser is None:
        # No parser to read the answer with: what remains is the named tool's check.
        if isinstance(body.tool_choice, dict):
            check_named_tool(body, body.tool_choice)
        return None
    tool_format = _tool_format(body, tool_call_parser)
    opened = None
    thinking = (body.chat_template_kwargs or {}).get("enable_thinking", True)
    if reasoning_parser is not None and thinking is not False:
        tail = ""
        if preprocessor is not None:
            tail_ids = prompt_token_ids[-_PROMPT_TAIL_TOKENS:]
            tail = preprocessor.decode(tail_ids, skip_special_tokens=False)
        opened = opens_in_reasoning(reasoning_parser, tail)
    if tool_format is None and opened is None:
        return None
    return OutputParsing(
        tool_format,
        tool_schemas(body.tools) if tool_format is not None else {},
        body.parallel_tool_calls is not False,
        opened,
        calls_only=bool(body.stream)
        and tool_format is not None
        and (isinstance(body.tool_choice, dict) or body.tool_choice == "required"),
    )


def _tool_format(body: ChatCompletionRequest, parser: str | None) -> ToolCallFormat | None:
    """Tools reach the chat template; calls are read only with a configured parser, and
    ``tool_choice: none`` leaves the answer as text (``required`` and a named function
    constrain it to calls: :func:`penstock.serving.guided.tool_call_constraint`)."""
    choice = body.tool_choice
    if isinstance(choice, dict):
        check_named_tool(body, choice)
    if not body.tools or choice == "none" or parser is None:
        return None
    return TOOL_CALL_FORMATS[parser]


def check_named_tool(body: ChatCompletionRequest, choice: dict[str, object]) -> None:
    """400 unless ``choice`` names one of the request's function tools."""
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    known = [tool.function.name for tool in body.tools or ()]
    if name not in known:
        listed = ", ".join(repr(tool) for tool in known) or "none"
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not among the request's "
            f"tools ({listed})",
            param="tool_choice",
        )
