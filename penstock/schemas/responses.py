"""Request models of the OpenAI Responses API (``POST /v1/responses``), validated at the edge.

Input items are told apart by ``type`` (a message may leave it out, as the SDK's
``EasyInputMessage`` does); an item of a type this server does not know fails validation
naming its place (``input[2].type``). Only function tools are served: a built-in tool
(``web_search``, ``file_search``, ...) fails naming ``tools[i].type``. Unknown top-level
fields are kept, as on the chat route, so the route can reject them by name or pass on the
sampling extensions it shares with chat (``top_k``, ``min_p``, ``seed``, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag

from penstock.schemas.openai import FunctionDefinition, PositiveInt
from penstock.schemas.unicode import JSONValue, RequestModel


class _Strict(RequestModel):
    model_config = ConfigDict(extra="forbid")


class _Item(RequestModel):
    # Items the server returned (``id``, ``status``) come back as input unchanged.
    model_config = ConfigDict(extra="ignore")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | InputImage | Refusal, Field(discriminator="type")]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []


_ITEM_TAGS = {
    "message": "Message",
    "function_call": "FunctionCall",
    "function_call_output": "FunctionCallOutput",
    "reasoning": "Reasoning",
}


def _item_tag(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


# Tags are capitalised so error locations leave them out (``input[2].call_id``).
InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[ReasoningItem, Tag("Reasoning")],
    Discriminator(
        _item_tag,
        custom_error_type="unsupported_item_type",
        custom_error_message="the item's type is not one this server takes: "
        + ", ".join(_ITEM_TAGS),
    ),
]


def _text_or_items(value: Any) -> str:
    return "list" if isinstance(value, list) else "str"


class FunctionTool(FunctionDefinition):
    """A tool as the Responses API spells it: the function's fields at the top."""

    type: str

    def as_chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


def _function_tool(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "function":
        raise ValueError(f"only function tools are supported; got type {kind!r}")
    return value


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# OpenAI's bounds: 16 pairs, keys of at most 64 characters, values of at most 512.
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    # Left out or empty: the served model (as chat and completions allow).
    model: str = ""
    input: Annotated[
        Annotated[str, Tag("str")] | Annotated[list[InputItem], Tag("list"), Field(min_length=1)],
        Discriminator(_text_or_items),
    ]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: TextOptions | None = None
    tools: list[Annotated[FunctionTool, BeforeValidator(_function_tool)]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: Metadata | None = None
    user: str | None = None

    @property
    def items(self) -> list[Any]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
