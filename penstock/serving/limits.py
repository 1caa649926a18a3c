"""The checks a request passes before any engine work: operator limits, the model's
vocabulary and context length, and what the engine can honour.

They need the serving context (settings, the served model), so they live here rather than
in the schemas; the routes stay thin.
"""

from __future__ import annotations

from starlette.requests import Request

from penstock.engines.contract import SUPPORTS_AUDIO_INPUT, SUPPORTS_IMAGE_INPUT, SUPPORTS_PRIORITY
from penstock.errors import InvalidRequestError, ServiceUnavailableError
from penstock.gateway import Gateway, ServedModel
from penstock.multimodal.inputs import MediaRef
from penstock.preprocess import Preprocessor, check_prompt_chars
from penstock.schemas.fields import refuse_unknown, refuse_unsupported
from penstock.schemas.openai import SamplingFields
from penstock.serving.deadline import header
from penstock.settings import Settings


def served_model(
    gateway: Gateway, body: SamplingFields, endpoint_type: str, serves: str
) -> ServedModel:
    """The model ``body`` names, once it is known to serve ``endpoint_type`` within limits;
    a body that names none (``model`` left out or empty, as vLLM allows) gets the first
    served model, written into it for the response."""
    if not body.model:
        body.model = default_model_name(gateway)
    model = gateway.resolve(body.model)
    if endpoint_type not in model.endpoint_types:
        raise InvalidRequestError(
            f"The model '{body.model}' does not serve {serves}", param="model"
        )
    check_common_limits(body, gateway.settings, model)
    return model


def default_model_name(gateway: Gateway) -> str:
    """The model a request that names none is served by: the first (the base model)."""
    listed = gateway.listed_models()
    if not listed:
        raise ServiceUnavailableError("no model is being served")
    return listed[0].name


def check_common_limits(body: SamplingFields, settings: Settings, model: ServedModel) -> None:
    refuse_unsupported(body, body.unsupported)
    refuse_unknown(body, settings.allow_unknown_fields)
    if body.n > settings.max_n:
        raise InvalidRequestError(
            f"n must be between 1 and {settings.max_n}; got {body.n}", param="n"
        )
    if body.n > 1 and body.temperature == 0:
        # vLLM's rule: greedy choices would all be the same text.
        raise InvalidRequestError(
            f"n must be 1 when using greedy sampling, got {body.n}", param="n"
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
    if body.priority and settings.scheduling_policy != "priority":
        # As vLLM: a priority is honoured only where the operator chose priority scheduling.
        raise InvalidRequestError(
            f"priority {body.priority} needs priority scheduling, which this server does not "
            "use (--scheduling-policy priority): leave priority at 0",
            param="priority",
            code="unsupported_parameter",
        )
    if body.priority and not engine_capability(model, SUPPORTS_PRIORITY):
        raise InvalidRequestError(
            f"The model '{body.model}' does not schedule by priority: leave priority at 0",
            param="priority",
            code="unsupported_parameter",
        )


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
