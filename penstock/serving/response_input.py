"""A Responses API request as the chat request it amounts to.

The conversation becomes chat messages: ``instructions`` first (a system message, never
carried to the next turn, as OpenAI does), then the stored conversation a
``previous_response_id`` names, then the input items: messages as they are, each
``function_call`` as a tool call of an assistant message (consecutive calls in one
message), each ``function_call_output`` as a tool message. Reasoning items are accepted
and not rendered: chat templates drop the reasoning of earlier turns; they are stored with
the input, so their summaries together may be no longer than a prompt could be
(:func:`reasoning_chars`). The rest maps
field for field (``max_output_tokens`` to ``max_tokens``, ``text.format`` to
``response_format``, function tools to chat tools), and the chat request's own
validation and limits apply unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from penstock.errors import InvalidRequestError
from penstock.schemas.openai import ChatCompletionRequest
from penstock.schemas.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    MessageItem,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    TextFormat,
)


def turn_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _content(item, f"input[{i}]")})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            # The calls of one turn follow its text, as the chat route answers them.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            text = output if isinstance(output, str) else "".join(p.text for p in output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return messages


def reasoning_chars(body: ResponsesRequest) -> int:
    """The characters of the input's reasoning summaries, which no prompt holds."""
    return sum(
        len(part.text)
        for item in body.items
        if isinstance(item, ReasoningItem)
        for part in item.summary
    )


def _content(item: MessageItem, where: str) -> str | list[dict[str, Any]]:
    if isinstance(item.content, str):
        return item.content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(item.content):
        if isinstance(part, InputText):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, Refusal):
            parts.append({"type": "text", "text": part.refusal})
        elif isinstance(part, InputImage):
            if part.image_url is None:
                raise InvalidRequestError(
                    "only images given by image_url are supported: this server keeps no files",
                    param=f"{where}.content[{j}].file_id",
                    code="unsupported_content",
                )
            image = {"url": part.image_url, **({"detail": part.detail} if part.detail else {})}
            parts.append({"type": "image_url", "image_url": image})
    return parts


def _response_format(text_format: TextFormat | None) -> dict[str, Any] | None:
    if text_format is None:
        return None
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    if text_format.name is None:
        raise InvalidRequestError(
            "a json_schema format needs a name", param="text.format.name", code="missing_name"
        )
    schema = {
        "name": text_format.name,
        "description": text_format.description,
        "schema": text_format.schema_,
        "strict": text_format.strict,
    }
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }


def _tool_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


# The chat fields a Responses request may carry at its top level: the sampling extensions
# vLLM and SGLang clients send. Any other chat field (``n``, ``messages``, ``logprobs``,
# ...) has a Responses spelling or no meaning here; fields chat doesn't know either are
# refused by the chat request's own check, by name.
_CHAT_EXTENSIONS = frozenset(
    {
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "nvext",
        "chat_template_kwargs",
    }
)


def _extensions(body: ResponsesRequest) -> dict[str, Any]:
    extra = body.model_extra or {}
    for name in extra:
        if name in ChatCompletionRequest.model_fields and name not in _CHAT_EXTENSIONS:
            raise InvalidRequestError(
                f"'{name}' is a chat completions field, not a Responses API one",
                param=name,
                code="unknown_field",
            )
    return extra


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request of ``body`` over ``messages`` (the whole conversation)."""
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    fields: dict[str, Any] = {
        **_extensions(body),
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [tool.as_chat_tool() for tool in body.tools] if body.tools else None,
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text.format if body.text else None),
        "user": body.user,
        "stream": body.stream,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {name: value for name, value in fields.items() if value is not None}
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise InvalidRequestError(f"{where}: {error['msg']}", param=where) from exc
