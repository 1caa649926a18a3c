"""From a validated OpenAI request to the engine's ``GenerateRequest`` dict.

Checks that need the serving context (operator limits, the model's vocabulary and
context length, what the engine can honour) live here, so the routes stay thin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, ParamSpec, TypeVar

from starlette.requests import Request

from penstock.engines.context import Context
from penstock.engines.contract import SUPPORTS_AUDIO_INPUT, SUPPORTS_IMAGE_INPUT, GenerateRequest
from penstock.errors import InvalidRequestError, clip
from penstock.gateway import Gateway, ServedModel
from penstock.metadata_upload import MetadataUploader, under_root
from penstock.multimodal.inputs import MediaInputs, MediaRef
from penstock.preprocess import Preprocessor, check_prompt_chars
from penstock.schemas.openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    InputAudio,
    SamplingFields,
)
from penstock.serving.deadline import Deadline, header
from penstock.settings import Settings

P = ParamSpec("P")
T = TypeVar("T")

# Fields an engine's runtime_data may advertise to accept requests the gateway would
# otherwise refuse rather than let the engine ignore silently.
SUPPORTS_RESPONSE_FORMAT = "supports_response_format"
# The header naming a client's session (its key in the engine context's metadata too).
SESSION_HEADER = "x-session-id"
_SESSION_KEY = SESSION_HEADER.encode()


class PassthroughRequest(GenerateRequest, total=False):
    """The contract's request plus what the gateway passes on outside its groups."""

    # Vendor extensions, as the client sent them.
    nvext: dict[str, Any]
    # Structured output, only for engines that advertise SUPPORTS_RESPONSE_FORMAT.
    response_format: dict[str, Any]


class ChatPrompt(NamedTuple):
    """A rendered conversation: its token ids and the inputs that travel beside them."""

    token_ids: list[int]
    multi_modal_data: dict[str, Any] | None
    response_format: dict[str, Any] | None


def engine_context(
    request: Request, prompt_index: int | None = None, *, user: str | None = None
) -> Context:
    """The engine's view of an HTTP request: its id (one per prompt of a batch) and trace.

    ``prompt_index`` tells the prompts of a batch apart; ``x-request-id`` stays the
    client's id so every part of the batch can be traced back to it. The session key
    (the ``X-Session-Id`` header, else the body's ``user``) travels as ``x-session-id``:
    a fleet keeps a session on one replica by it.
    """
    request_id = request.state.request_id
    metadata = {"x-request-id": request_id}
    session = header(request, _SESSION_KEY) or user
    if session:
        metadata[SESSION_HEADER] = session
    return Context(
        request_id if prompt_index is None else f"{request_id}-{prompt_index}",
        metadata,
        traceparent=header(request, b"traceparent"),
        tracestate=header(request, b"tracestate"),
    )


def served_model(
    gateway: Gateway, body: SamplingFields, endpoint_type: str, serves: str
) -> ServedModel:
    """The model ``body`` names, once it is known to serve ``endpoint_type`` within limits."""
    model = gateway.resolve(body.model)
    if endpoint_type not in model.endpoint_types:
        raise InvalidRequestError(
            f"The model '{body.model}' does not serve {serves}", param="model"
        )
    check_common_limits(body, gateway.settings, model)
    return model


def check_common_limits(body: SamplingFields, settings: Settings, model: ServedModel) -> None:
    if body.model_extra and not settings.allow_unknown_fields:
        unknown = sorted(body.model_extra)
        raise InvalidRequestError(
            f"Unknown field(s): {', '.join(clip(name) for name in unknown)}",
            param=unknown[0],
            code="unknown_field",
        )
    if body.n > settings.max_n:
        raise InvalidRequestError(
            f"n must be between 1 and {settings.max_n}; got {body.n}", param="n"
        )
    if len(body.stop_list) > settings.max_stop_sequences:
        raise InvalidRequestError(
            f"at most {settings.max_stop_sequences} stop sequences are allowed; "
            f"got {len(body.stop_list)}",
            param="stop",
        )
    if body.logit_bias:
        raise InvalidRequestError("logit_bias is not supported by this server", param="logit_bias")
    if model.host.is_raw:
        raise InvalidRequestError(
            f"The model '{body.model}' generates media; use its media endpoint", param="model"
        )


def metadata_uploader(body: SamplingFields, settings: Settings) -> MetadataUploader | None:
    """The upload ``nvext.metadata_upload`` asks for, under the operator's root.

    The request's ``url`` is only a key relative to ``--metadata-upload-url``: a client
    never picks the scheme, the host or the folder the server writes to.
    """
    try:
        asked = MetadataUploader.from_backend_request({"nvext": body.nvext})
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="nvext.metadata_upload") from exc
    if asked is None:
        return None
    if settings.metadata_upload_url is None:
        raise InvalidRequestError(
            "metadata uploads are not enabled on this server",
            param="nvext.metadata_upload",
            code="metadata_upload_disabled",
        )
    try:
        return under_root(settings.metadata_upload_url, asked.url)
    except ValueError as exc:
        raise InvalidRequestError(
            str(exc), param="nvext.metadata_upload.url", code="invalid_upload_key"
        ) from exc


def engine_capability(model: ServedModel, name: str) -> bool:
    config = model.host.engine_config
    return bool(config and config.runtime_data and config.runtime_data.get(name))


def check_token_ids(token_ids: list[int], model: ServedModel, param: str) -> None:
    if model.preprocessor is None:
        return
    vocab = model.preprocessor.vocab_size
    for token in token_ids:
        if token >= vocab:
            raise InvalidRequestError(
                f"{param} contains token id {token}, outside the vocabulary (size {vocab})",
                param=param,
            )


def chars_per_token(settings: Settings, preprocessor: Preprocessor) -> float:
    """The factor of the prompt-length bound: the operator's, else the vocabulary's."""
    if settings.max_chars_per_token is not None:
        return settings.max_chars_per_token
    return preprocessor.max_token_chars


def check_prompt_length(
    settings: Settings, model: ServedModel, preprocessor: Preprocessor, chars: int, param: str
) -> None:
    """400 for a prompt too long to fit the context, judged by its length alone."""
    check_prompt_chars(
        chars,
        model.context_length,
        chars_per_token(settings, preprocessor),
        prompt_param=param,
    )


def body_size(request: Request) -> int:
    """The request body's declared length (0 when it came chunked)."""
    try:
        return int(header(request, b"content-length") or 0)
    except ValueError:
        return 0


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


def check_budget(prompt_len: int, max_tokens: int | None, model: ServedModel, param: str) -> None:
    """Prompt + requested tokens must fit the context; the engine decides when none asked.

    An engine's ``TokenBudget`` replaces the context length with its ``combined_limit``
    and may leave either overflow to the engine.
    """
    budget = model.token_budget
    limit = budget.combined_limit if budget is not None else model.context_length
    if limit is None:
        return
    from penstock.preprocess import check_token_budget

    check_token_budget(
        prompt_len,
        max_tokens,
        limit,
        prompt_param=param,
        reject_prompt_overflow=budget is None or budget.reject_prompt_overflow,
        reject_total_overflow=budget is None or budget.reject_total_overflow,
    )


def _sampling_options(body: SamplingFields) -> dict[str, Any]:
    options: dict[str, Any] = {"n": body.n}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(body, name)
        if value is not None:
            options[name] = value
    return options


def _stop_conditions(body: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    conditions: dict[str, Any] = {}
    if max_tokens is not None:
        conditions["max_tokens"] = max_tokens
    if body.min_tokens:
        conditions["min_tokens"] = body.min_tokens
    if body.stop_token_ids:
        conditions["stop_token_ids"] = list(body.stop_token_ids)
    if body.ignore_eos:
        conditions["ignore_eos"] = True
    return conditions


def generate_request(
    body: SamplingFields,
    model: ServedModel,
    token_ids: list[int],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    multi_modal_data: dict[str, Any] | None = None,
    response_format: dict[str, Any] | None = None,
    uploader: MetadataUploader | None = None,
) -> GenerateRequest:
    request = PassthroughRequest(
        token_ids=token_ids,
        # The canonical name (aliases resolved): a LoRA engine picks the adapter by it.
        model=model.name,
        sampling_options=_sampling_options(body),
        stop_conditions=_stop_conditions(body, max_tokens),
        output_options={"logprobs": logprobs} if logprobs is not None else {},
    )
    if body.nvext:
        request["nvext"] = _engine_nvext(body.nvext, uploader)
    if multi_modal_data is not None:
        request["multi_modal_data"] = multi_modal_data
    if response_format is not None:
        request["response_format"] = response_format
    return request


def _engine_nvext(nvext: dict[str, Any], uploader: MetadataUploader | None) -> dict[str, Any]:
    """``nvext`` as the engine sees it: an upload names the resolved place under the root,
    so an engine that uploads itself (Dynamo's contract) writes where the gateway would."""
    if uploader is None:
        return nvext
    return {**nvext, "metadata_upload": {"url": uploader.url}}


def _flatten_content(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text for part in content if part.type == "text")


_MEDIA_PART_TYPES = frozenset({"image_url", "input_audio", "audio_url"})


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
        rendered = message.model_dump(exclude_none=True)
        # Content with media keeps its parts: the chat template places them (see
        # ``preprocess.chat_template``); text-only content is one string.
        if not _has_media(message.content):
            rendered["content"] = _flatten_content(message.content)
        chars += len(_flatten_content(message.content))
        messages.append(rendered)
    check_prompt_length(gateway.settings, model, pre, chars, "messages")
    response_format: dict[str, Any] | None = None
    if body.response_format is not None and body.response_format.type != "text":
        if not engine_capability(model, SUPPORTS_RESPONSE_FORMAT):
            raise InvalidRequestError(
                f"The model '{body.model}' can't honour response_format "
                f"'{body.response_format.type}'",
                param="response_format",
                code="unsupported_parameter",
            )
        response_format = body.response_format.model_dump(by_alias=True)
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
            chat_template_kwargs=body.chat_template_kwargs,
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
    return ChatPrompt(token_ids, multi_modal_data, response_format)


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


def check_media(
    settings: Settings,
    model: ServedModel,
    name: str,
    images: list[MediaRef],
    audio: list[MediaRef],
) -> None:
    """400 for media the engine can't take or more items than the operator allows."""
    for refs, capability, kind, limit, flag in (
        (
            images,
            SUPPORTS_IMAGE_INPUT,
            "image",
            settings.media_max_images_per_request,
            "--media-max-images-per-request",
        ),
        (
            audio,
            SUPPORTS_AUDIO_INPUT,
            "audio",
            settings.media_max_audio_per_request,
            "--media-max-audio-per-request",
        ),
    ):
        if not refs:
            continue
        if not engine_capability(model, capability):
            raise InvalidRequestError(
                f"The model '{name}' does not accept {kind} input",
                param=refs[0].param,
                code="unsupported_content",
            )
        if len(refs) > limit:
            raise InvalidRequestError(
                f"at most {limit} {kind} parts are allowed per request (the server's {flag}); "
                f"got {len(refs)}",
                param=refs[limit].param,
                code="too_many_media_items",
            )


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
) -> list[int]:
    """The conversation's token ids; the rendered text passes the length bound first, so
    what the messages alone don't show (tools, tool-call arguments) can't slip past it."""
    text = preprocessor.render_chat(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
    )
    check_prompt_length(settings, model, preprocessor, len(text), "messages")
    return preprocessor.encode(text)


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
