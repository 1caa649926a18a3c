"""From a validated OpenAI request to the engine's ``GenerateRequest`` dict.

Checks that need the serving context (operator limits, the model's vocabulary and
context length, what the engine can honour) live here, so the routes stay thin.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from starlette.requests import Request

from penstock.engines.context import Context
from penstock.engines.contract import GenerateRequest
from penstock.errors import InvalidRequestError, clip
from penstock.gateway import Gateway, ServedModel
from penstock.metadata_upload import MetadataUploader, under_root
from penstock.schemas.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from penstock.settings import Settings

# Fields an engine's runtime_data may advertise to accept requests the gateway would
# otherwise refuse rather than let the engine ignore silently.
SUPPORTS_RESPONSE_FORMAT = "supports_response_format"
SUPPORTS_IMAGE_INPUT = "supports_image_input"


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


def engine_context(request: Request, prompt_index: int | None = None) -> Context:
    """The engine's view of an HTTP request: its id (one per prompt of a batch) and trace.

    ``prompt_index`` tells the prompts of a batch apart; ``x-request-id`` stays the
    client's id so every part of the batch can be traced back to it.
    """
    request_id = request.state.request_id
    return Context(
        request_id if prompt_index is None else f"{request_id}-{prompt_index}",
        {"x-request-id": request_id},
        traceparent=request.headers.get("traceparent"),
        tracestate=request.headers.get("tracestate"),
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


def chat_prompt(body: ChatCompletionRequest, model: ServedModel) -> ChatPrompt:
    """Render and tokenize the conversation, checking what the engine can take."""
    if model.preprocessor is None:
        raise InvalidRequestError(
            f"The model '{body.model}' has no tokenizer or chat template configured; "
            "start the server with --tokenizer PATH, or send token ids to /v1/completions",
            param="messages",
        )
    images: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for message in body.messages:
        if isinstance(message.content, list):
            images += [
                part.image_url.model_dump(exclude_none=True)
                for part in message.content
                if part.type == "image_url"
            ]
        rendered = message.model_dump(exclude_none=True)
        rendered["content"] = _flatten_content(message.content)
        messages.append(rendered)
    multi_modal_data: dict[str, Any] | None = None
    if images:
        if not engine_capability(model, SUPPORTS_IMAGE_INPUT):
            raise InvalidRequestError(
                f"The model '{body.model}' does not accept image input",
                param="messages",
                code="unsupported_content",
            )
        multi_modal_data = {"image_url": images}
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
    token_ids = model.preprocessor.tokenize_chat(
        messages,
        add_generation_prompt=body.add_generation_prompt,
        tools=tools,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    return ChatPrompt(token_ids, multi_modal_data, response_format)


def completion_prompts(body: CompletionRequest, model: ServedModel) -> list[list[int]]:
    prompts = body.prompts()
    if isinstance(prompts[0], str):
        if model.preprocessor is None:
            raise InvalidRequestError(
                f"The model '{body.model}' has no tokenizer configured; start the server with "
                "--tokenizer PATH, or send the prompt as token ids",
                param="prompt",
            )
        encoded = [model.preprocessor.encode(text) for text in prompts]  # type: ignore[arg-type]
        if any(not ids for ids in encoded):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return encoded
    for ids in prompts:
        check_token_ids(ids, model, "prompt")  # type: ignore[arg-type]
    return prompts  # type: ignore[return-value]
