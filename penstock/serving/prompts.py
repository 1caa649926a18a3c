"""The prompt of a request as token ids: a conversation rendered with the chat template
and tokenized, or completion prompts tokenized or checked, with their media loaded.

Heavy rendering, tokenizing and id checking runs off the event loop
(:func:`off_loop`), within the request's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, ParamSpec, TypeVar

from starlette.requests import Request

from penstock.errors import InvalidRequestError
from penstock.gateway import Gateway, ServedModel
from penstock.multimodal.inputs import MediaInputs, MediaRef
from penstock.preprocess import Preprocessor
from penstock.schemas.openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    InputAudio,
)
from penstock.serving.deadline import Deadline
from penstock.serving.limits import (
    body_size,
    check_budget,
    check_media,
    check_prompt_length,
    check_token_ids,
)
from penstock.settings import Settings

P = ParamSpec("P")

T = TypeVar("T")


class ChatPrompt(NamedTuple):
    """A rendered conversation: its token ids and the inputs that travel beside them."""

    token_ids: list[int]
    multi_modal_data: dict[str, Any] | None


async def off_loop(
    gateway: Gateway,
    deadline: Deadline | None,
    size: int,
    fn: Callable[P, T],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """``fn`` on the preprocessing threads when ``size`` says it is heavy; within the
    request's deadline."""
    work = gateway.preprocess.run(size, fn, *args, **kwargs)
    return await (work if deadline is None else deadline.within(work))


def _flatten_content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text for part in content if part.type == "text")


_MEDIA_PART_TYPES = frozenset({"image_url", "input_audio", "audio_url"})
_MESSAGE_FIELDS = tuple(ChatMessage.model_fields)


def _rendered(message: ChatMessage) -> dict[str, Any]:
    """``message.model_dump(exclude_none=True)``. A message of text fields only (no parts,
    no tool calls, no undeclared fields) is read from its fields directly: its dump is
    those same strings, and pydantic's serializer cost several times as much a message."""
    if (
        message.tool_calls is None
        and not message.__pydantic_extra__
        and not isinstance(message.content, list)
    ):
        values = message.__dict__
        # A loop rather than a comprehension: no function call of its own.
        rendered = {}
        for name in _MESSAGE_FIELDS:
            value = values[name]
            if value is not None:
                rendered[name] = value
        return rendered
    return message.model_dump(exclude_none=True)


def _has_media(content: Any) -> bool:
    return isinstance(content, list) and any(part.type in _MEDIA_PART_TYPES for part in content)


async def chat_prompt(
    gateway: Gateway,
    body: ChatCompletionRequest,
    model: ServedModel,
    deadline: Deadline | None,
    request: Request,
    media: MediaInputs,
) -> ChatPrompt:
    """Render and tokenize the conversation, checking what the engine can take.

    Messages too long to fit are refused by their length before any rendering; the
    rendering and the tokenizing of a large request run off the event loop. Media parts
    are checked against the engine and the limits first, then fetched and decoded while
    the prompt is tokenized.
    """
    pre = model.preprocessor
    if pre is None:
        raise InvalidRequestError(
            f"The model '{body.model}' has no tokenizer or chat template configured; "
            "start the server with --tokenizer PATH, or send token ids to /v1/completions",
            param="messages",
        )
    images, audio = media_refs(body.messages)
    check_media(gateway.settings, model, body.model, images, audio)
    messages: list[dict[str, Any]] = []
    chars = 0
    for message in body.messages:
        rendered = _rendered(message)
        # Content with media keeps its parts: the chat template places them (see
        # ``preprocess.chat_template``); text-only content is one string.
        if not _has_media(message.content):
            rendered["content"] = _flatten_content(message.content)
        chars += len(_flatten_content(message.content))
        messages.append(rendered)
    check_prompt_length(gateway.settings, model, pre, chars, "messages")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None

    def tokenize() -> Awaitable[list[int]]:
        return gateway.preprocess.run(
            max(chars, body_size(request)),
            render_and_tokenize,
            gateway.settings,
            model,
            pre,
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tools=tools,
            chat_template_kwargs=body.template_kwargs,
            add_special_tokens=body.add_special_tokens,
        )

    async def prompt_and_media() -> tuple[list[int], dict[str, Any] | None]:
        # Without media nothing runs beside the tokenizing: no task to start.
        if not images and not audio:
            return await tokenize(), None
        loads = asyncio.ensure_future(load_media(media, images, audio))
        try:
            token_ids = await tokenize()
        except BaseException:
            loads.cancel()
            raise
        return token_ids, await loads

    work = prompt_and_media()
    token_ids, multi_modal_data = await (work if deadline is None else deadline.within(work))
    return ChatPrompt(token_ids, multi_modal_data)


def media_refs(messages: list[ChatMessage]) -> tuple[list[MediaRef], list[MediaRef]]:
    """The image and the audio references of a conversation, in order, each with the
    field that named it."""
    images: list[MediaRef] = []
    audio: list[MediaRef] = []
    for m, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for p, part in enumerate(message.content):
            where = f"messages[{m}].content[{p}]"
            if part.type == "image_url":
                images.append(MediaRef(part.image_url.url, f"{where}.image_url.url"))
            elif part.type == "input_audio":
                url = _audio_data_url(part.input_audio)
                audio.append(MediaRef(url, f"{where}.input_audio.data"))
            elif part.type == "audio_url":
                audio.append(MediaRef(part.audio_url.url, f"{where}.audio_url.url"))
    return images, audio


def _audio_data_url(audio: InputAudio) -> str:
    return f"data:audio/{audio.format.lower()};base64,{audio.data}"


async def load_media(
    media: MediaInputs, images: list[MediaRef], audio: list[MediaRef]
) -> dict[str, Any] | None:
    """The engine's ``multi_modal_data``: every item fetched and decoded, in Dynamo's
    ``Decoded`` item shape (see :mod:`penstock.engines.contract`); None without media."""
    if not images and not audio:
        return None
    image_loads = asyncio.ensure_future(media.load_images(images))
    audio_loads = asyncio.ensure_future(media.load_audio(audio))
    try:
        loaded_images, loaded_audio = await asyncio.gather(image_loads, audio_loads)
    finally:
        # One kind failing ends the other's loads too.
        image_loads.cancel()
        audio_loads.cancel()
    data: dict[str, Any] = {}
    if loaded_images:
        data["image_url"] = [{"Decoded": image} for image in loaded_images]
    if loaded_audio:
        data["audio_url"] = [{"Decoded": waveform} for waveform in loaded_audio]
    return data


def render_and_tokenize(
    settings: Settings,
    model: ServedModel,
    preprocessor: Preprocessor,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The conversation's token ids; the rendered text passes the length bound first, so
    what the messages alone don't show (tools, tool-call arguments) can't slip past it.
    ``add_special_tokens``: the tokenizer's own around them too (off for chat in vLLM)."""
    text = preprocessor.render_chat(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
    )
    check_prompt_length(settings, model, preprocessor, len(text), "messages")
    token_ids = preprocessor.encode(text)
    return preprocessor.with_special_tokens(token_ids) if add_special_tokens else token_ids


async def completion_prompts(
    gateway: Gateway, body: CompletionRequest, model: ServedModel, deadline: Deadline | None
) -> list[list[int]]:
    """Each prompt's token ids, checked against the vocabulary and the context.

    Text prompts too long to fit are refused by their length before any tokenizing;
    tokenizing many characters, or checking many ids, runs off the event loop.
    """
    prompts = body.prompts()
    if isinstance(prompts[0], str):
        pre = model.preprocessor
        if pre is None:
            raise InvalidRequestError(
                f"The model '{body.model}' has no tokenizer configured; start the server with "
                "--tokenizer PATH, or send the prompt as token ids",
                param="prompt",
            )
        texts: list[str] = prompts
        for text in texts:
            check_prompt_length(gateway.settings, model, pre, len(text), "prompt")
        size = sum(len(text) for text in texts)
        encoded = await off_loop(gateway, deadline, size, _encode_all, pre, texts)
        if body.add_special_tokens:
            encoded = [pre.with_special_tokens(ids) for ids in encoded]
        if any(not ids for ids in encoded):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        for ids in encoded:
            check_budget(len(ids), body.max_tokens, model, "prompt")
        return encoded
    id_prompts: list[list[int]] = prompts
    # The budget first: it needs only the lengths, the vocabulary check every id.
    for ids in id_prompts:
        check_budget(len(ids), body.max_tokens, model, "prompt")
    size = sum(len(ids) for ids in id_prompts)
    await off_loop(gateway, deadline, size, _check_all_token_ids, id_prompts, model)
    return id_prompts


def _encode_all(preprocessor: Preprocessor, texts: list[str]) -> list[list[int]]:
    return [preprocessor.encode(text) for text in texts]


def _check_all_token_ids(prompts: list[list[int]], model: ServedModel) -> None:
    for ids in prompts:
        check_token_ids(ids, model, "prompt")
