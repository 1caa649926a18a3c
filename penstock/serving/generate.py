"""SGLang's native token-in/token-out ``/generate`` and ``/health_generate``, on the one
serving path of completions (one :class:`Generation`, :func:`respond`).

Request: exactly one of ``text`` (tokenized without a chat template) or ``input_ids``;
``sampling_params`` (``max_new_tokens`` default 128, ``min_new_tokens``, ``temperature``
default 1.0, ``top_p``, ``top_k``, ``min_p``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``,
``seed`` (or SGLang's ``sampling_seed``), ``skip_special_tokens``,
``spaces_between_special_tokens``, ``no_stop_trim``, ``custom_params``); ``stream``;
``return_logprob`` with ``top_logprobs_num``, ``return_text_in_logprobs`` and
``logprob_start_len`` (from that prompt position on, the prompt's logprobs too, for
engines that report them); ``model`` (optional: a served model or adapter name, else
``lora_path``; default the first served model); ``rid`` (optional: the engine request
id, for ``/abort_request``); ``log_metrics``, ``no_logs`` and ``extra_key`` change no
output. The other fields of SGLang's ``SamplingParams`` and ``GenerateReqInput``
(:data:`SAMPLING_UNSUPPORTED`, :data:`GENERATE_UNSUPPORTED`) are accepted only at the
value that asks for nothing, else a 400 naming them; a field neither defines is ignored
and named in the ``x-penstock-ignored-fields`` header, or with
``--no-allow-unknown-fields`` a 400 ``unknown_field`` naming its path, at any depth. One
prompt per request: a batch is a 400.

Response (and each stream event, ``data: {...}`` then ``data: [DONE]``)::

    {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "weight_version", "weight_versions",
     "output_token_logprobs"?, "output_top_logprobs"?, "input_token_logprobs"?,
     "input_top_logprobs"?}}

Stream events are cumulative, as SGLang streams them by default: each carries the whole
text and every output id so far. ``finish_reason`` is None until the last event, then
``{"type": "stop", "matched": null}``, ``{"type": "length", "length": n}`` or
``{"type": "abort", "message"}``. ``output_token_logprobs`` are ``[logprob, token_id,
text]`` triples (``text`` null unless ``return_text_in_logprobs``). With
``logprob_start_len`` >= 0, ``input_token_logprobs`` holds the same triples for the prompt
from that position (the first prompt token's logprob is null), and with
``top_logprobs_num`` ``input_top_logprobs`` the most likely tokens at each. ``weight_version``
is the version that produced the latest token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import orjson
from pydantic import ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from penstock.engines.context import Context
from penstock.engines.contract import SUPPORTS_PROMPT_LOGPROBS
from penstock.errors import InvalidRequestError, PenstockError, ServiceUnavailableError
from penstock.gateway import Gateway, ServedModel
from penstock.schemas.fields import refuse_unknown, refuse_unsupported
from penstock.schemas.openai import CompletionRequest, NonNegativeInt, PositiveInt
from penstock.schemas.unicode import JSONValue, RequestModel
from penstock.serving.choice import ChoiceState, Delta, LogprobEntry
from penstock.serving.deadline import Deadline, request_deadline
from penstock.serving.framing import JSONObject
from penstock.serving.generation import Generation
from penstock.serving.guided import check_can_constrain, sampling_guided_decoding
from penstock.serving.limits import default_model_name, engine_capability, served_model
from penstock.serving.prompts import completion_prompts
from penstock.serving.requests import engine_context, generate_request, key_cache_scope
from penstock.serving.stream import ResponsePlan, respond

DEFAULT_MAX_NEW_TOKENS = 128
HEALTH_GENERATE_TIMEOUT_S = 20.0


# SGLang's sampling fields this server cannot honour, each with the value that asks for
# nothing (accepted as such; any other value is a 400 naming the field).
SAMPLING_UNSUPPORTED: dict[str, Any] = {
    "n": 1,
    "stop_regex": None,
    "logit_bias": None,
    "stream_interval": 1,
}

# The same for the fields of SGLang's ``GenerateReqInput``.
GENERATE_UNSUPPORTED: dict[str, Any] = {
    "input_embeds": None,
    # Empty lists are no media: AReaL sends ``image_data: []`` with every text request.
    "image_data": [],
    "video_data": [],
    "audio_data": [],
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "return_entropy": False,
    "return_bytes": False,
    "session_params": None,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "data_parallel_rank": None,
    "background": False,
    "modalities": None,
    "priority": None,
    "custom_labels": None,
    "conversation_id": None,
}


class SamplingParams(RequestModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    max_new_tokens: PositiveInt | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: NonNegativeInt = 0
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    seed: int | None = None
    # SGLang's name for the per-request seed.
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    # Decoded as a fast tokenizer decodes, which places special tokens the same either way.
    spaces_between_special_tokens: bool = True
    # Keep the matched stop string in ``text``.
    no_stop_trim: bool = False
    # Data for a custom logit processor; none runs here (``custom_logit_processor`` is
    # refused), so it changes nothing, as in SGLang without one.
    custom_params: dict[str, JSONValue] | None = None
    # Output constraints: a JSON schema (as its text), a regex, an EBNF grammar, a
    # structural tag (see ``serving.guided``).
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None


class GenerateBody(RequestModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    text: str | None = None
    input_ids: list[NonNegativeInt] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Field(ge=0, le=20)] = 0
    # -1: no prompt logprobs; else the prompt position they start from.
    logprob_start_len: Annotated[int, Field(ge=-1)] = -1
    model: str | None = None
    rid: str | None = None
    # Token text as the third element of each logprob triple.
    return_text_in_logprobs: bool = False
    # SGLang's adapter name: here, the served model (or adapter) to use.
    lora_path: str | None = None
    # Logging and cache-key hints that change no output.
    log_metrics: bool = True
    no_logs: bool = False
    extra_key: str | None = None


def _finish_reason(reason: str | None, completion_tokens: int) -> dict[str, Any] | None:
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": None}
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    return {"type": reason}


def _logprob_fields(
    entries: list[LogprobEntry], top: int, token_text: Callable[[int], str | None]
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "output_token_logprobs": [[e.logprob, e.token_id, token_text(e.token_id)] for e in entries]
    }
    if top:
        fields["output_top_logprobs"] = [
            [[alt.logprob, alt.token_id, token_text(alt.token_id)] for alt in e.top]
            for e in entries
        ]
    return fields


def _no_text(token_id: int) -> None:
    return None


def _input_logprob_fields(
    prompt: list[int],
    positions: list[Any],
    start: int,
    top: int,
    token_text: Callable[[int], str | None],
) -> dict[str, Any]:
    """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs``) from prompt position
    ``start``, out of the engine's prompt logprobs (the prompt token first at each)."""

    def triple(entry: dict[str, Any]) -> list[Any]:
        return [entry["logprob"], entry["token_id"], token_text(entry["token_id"])]

    tokens: list[Any] = []
    tops: list[Any] = []
    for token, entries in zip(prompt[start:], positions[start:], strict=True):
        if entries is None:
            # The first prompt token follows nothing: it has no logprob.
            tokens.append([None, token, token_text(token)])
            tops.append(None)
            continue
        own, ranked = entries[0], list(entries[1:])
        tokens.append(triple(own))
        if own["rank"] <= top:
            ranked.insert(own["rank"] - 1, own)
        tops.append([triple(entry) for entry in ranked[:top]])
    fields: dict[str, Any] = {"input_token_logprobs": tokens}
    if top:
        fields["input_top_logprobs"] = tops
    return fields


class GenerateFormat:
    """SGLang's shapes: one object per event, cumulative, instead of OpenAI chunks."""

    id_prefix = "gen-"
    chunk_object = "generate"
    response_object = "generate"

    def __init__(
        self,
        top_logprobs: int,
        token_text: Callable[[int], str | None] = _no_text,
        input_start: int = -1,
    ) -> None:
        """``input_start``: the prompt position input logprobs start from; -1, none."""
        self.top_logprobs = top_logprobs
        self.token_text = token_text
        self.input_start = input_start
        self.generation: Generation | None = None

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        return []

    def _object(self, choice: ChoiceState, version: str | None) -> dict[str, Any]:
        generation = self.generation
        assert generation is not None
        completion_tokens = len(choice.token_ids)
        meta: dict[str, Any] = {
            "id": generation.context.id(),
            "finish_reason": _finish_reason(choice.finish_reason, completion_tokens),
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": generation.cached_tokens or 0,
            "weight_version": version,
            "weight_versions": choice.weight_version_segments(),
        }
        if choice.logprobs is not None:
            meta.update(_logprob_fields(choice.logprobs, self.top_logprobs, self.token_text))
        if self.input_start >= 0 and generation.prompt_logprobs is not None:
            meta.update(
                _input_logprob_fields(
                    generation.request["token_ids"],
                    generation.prompt_logprobs,
                    self.input_start,
                    self.top_logprobs,
                    self.token_text,
                )
            )
        return {"text": choice.text, "output_ids": list(choice.token_ids), "meta_info": meta}

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        if not delta.token_ids and delta.finish_reason is None:
            return None
        return self._object(delta.choice, delta.weight_version)

    def response_choice(self, generation: Generation, choice: ChoiceState) -> dict[str, Any]:
        version = choice.versions[-1].weight_version if choice.versions else None
        return self._object(choice, version or generation.weight_version)

    def response_fields(self, generations: Sequence[Generation]) -> dict[str, Any]:
        return {}

    def encoder(self, plan: ResponsePlan) -> GenerateEncoder:
        return GenerateEncoder()

    def reshape(self, response: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = response["choices"][0]
        return choice


class GenerateEncoder:
    """Each event is the object itself: no OpenAI chunk envelope, no usage frames."""

    __slots__ = ()

    def frame(
        self, choices: list[JSONObject], weight_version: str | None, usage: JSONObject | None = None
    ) -> bytes:
        return b"".join(b"data: " + orjson.dumps(item) + b"\n\n" for item in choices)


def _model_for(gateway: Gateway, name: str | None) -> str:
    return name or default_model_name(gateway)


# Sampling fields with the same name and meaning in completions.
_SHARED_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def completion_body(gateway: Gateway, body: GenerateBody) -> CompletionRequest:
    """The same request in completions' terms, so every check and limit applies as is.

    SGLang's fields this server cannot honour are refused by name first, then any field
    neither SGLang nor this server knows, at any depth (unless the operator allows them:
    then they are ignored, never passed on).
    """
    refuse_unsupported(body, GENERATE_UNSUPPORTED)
    refuse_unsupported(body.sampling_params, SAMPLING_UNSUPPORTED, "sampling_params")
    refuse_unknown(body, gateway.settings.allow_unknown_fields)
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError(
            "send exactly one of 'text' or 'input_ids'", param="text", code="invalid_value"
        )
    if body.input_ids is not None and not body.input_ids:
        raise InvalidRequestError("'input_ids' must not be empty", param="input_ids")
    params = body.sampling_params
    fields: dict[str, Any] = {
        name: getattr(params, name)
        for name in _SHARED_SAMPLING
        if getattr(params, name) is not None
    }
    seed = params.seed if params.seed is not None else params.sampling_seed
    model = _model_for(gateway, body.model or body.lora_path)
    for name in ("json_schema", "regex", "ebnf", "structural_tag"):
        if getattr(params, name) is not None:
            check_can_constrain(gateway.resolve(model), f"sampling_params.{name}", model)
    fields.update(
        model=model,
        prompt=body.text if body.text is not None else body.input_ids,
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        seed=seed,
        include_stop_str_in_output=params.no_stop_trim,
        stream=body.stream,
        logprobs=body.top_logprobs_num if body.return_logprob else None,
        prompt_logprobs=_prompt_logprobs(gateway, body, model),
        guided_json=params.json_schema,
        guided_regex=params.regex,
        guided_grammar=params.ebnf,
        structured_outputs=None
        if params.structural_tag is None
        else {"structural_tag": params.structural_tag},
    )
    try:
        return CompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise InvalidRequestError(f"{where}: {error['msg']}", param=where) from exc


def _prompt_logprobs(gateway: Gateway, body: GenerateBody, model: str) -> int | None:
    """``prompt_logprobs`` for ``logprob_start_len`` >= 0 with ``return_logprob``."""
    if body.logprob_start_len < 0 or not body.return_logprob:
        return None
    if not engine_capability(gateway.resolve(model), SUPPORTS_PROMPT_LOGPROBS):
        raise InvalidRequestError(
            f"logprob_start_len is not supported by the model '{model}': its engine reports "
            "no prompt logprobs; leave it at -1",
            param="logprob_start_len",
            code="unsupported_parameter",
        )
    if body.stream:
        raise InvalidRequestError(
            "logprob_start_len: prompt logprobs are not streamed; send it without stream",
            param="logprob_start_len",
        )
    return body.top_logprobs_num


def _generation(
    gateway: Gateway,
    model: ServedModel,
    body: CompletionRequest,
    token_ids: list[int],
    request: Request,
    rid: str | None,
    deadline: Deadline | None = None,
) -> Generation:
    context = engine_context(request)
    if rid is not None:
        context = Context(rid, {"x-request-id": request.state.request_id})
    return Generation(
        gateway,
        model,
        generate_request(
            body,
            model,
            token_ids,
            max_tokens=body.max_tokens,
            logprobs=body.logprobs,
            guided_decoding=sampling_guided_decoding(body, model),
            key_scope=key_cache_scope(request),
        ),
        context,
        stops=body.stop_list,
        keep_text=True,
        want_logprobs=body.logprobs is not None,
        endpoint="generate",
        streaming=body.stream,
        deadline=deadline,
    )


async def generate(gateway: Gateway, body: GenerateBody, request: Request) -> Response:
    deadline = request_deadline(request, gateway.settings)
    completion = completion_body(gateway, body)
    model = served_model(gateway, completion, "completions", "generate")
    try:
        (token_ids,) = await completion_prompts(gateway, completion, model, deadline)
    except InvalidRequestError as exc:
        # The checks name the completions field; this route's are ``text`` / ``input_ids``.
        if exc.param == "prompt":
            exc.param = "text" if body.text is not None else "input_ids"
        raise
    input_start = body.logprob_start_len if completion.prompt_logprobs is not None else -1
    if input_start >= len(token_ids):
        raise InvalidRequestError(
            f"logprob_start_len ({input_start}) must be less than the prompt's "
            f"{len(token_ids)} tokens",
            param="logprob_start_len",
        )
    generation = _generation(gateway, model, completion, token_ids, request, body.rid, deadline)
    pre = model.preprocessor
    token_text = pre.token_text if body.return_text_in_logprobs and pre is not None else _no_text
    top = body.top_logprobs_num if body.return_logprob else 0
    fmt = GenerateFormat(top, token_text, input_start)
    fmt.generation = generation
    plan = ResponsePlan(fmt, [generation], completion, None, deadline)
    return await respond(request, plan)


async def health_generate(gateway: Gateway, request: Request) -> dict[str, Any]:
    """One one-token generation within :data:`HEALTH_GENERATE_TIMEOUT_S`; 503 if it can't."""
    readiness = gateway.readiness()
    if not readiness.ready:
        raise ServiceUnavailableError(f"cannot generate: {readiness.reason}")
    model = gateway.listed_models()[0] if gateway.listed_models() else None
    if model is None:
        raise ServiceUnavailableError("cannot generate: no model is being served")
    completion = CompletionRequest(model=model.name, prompt=[0], max_tokens=1, ignore_eos=True)
    generation = _generation(gateway, model, completion, [0], request, None)
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            async for _ in generation.deltas():
                pass
    except TimeoutError:
        raise ServiceUnavailableError(
            f"cannot generate: no token within {HEALTH_GENERATE_TIMEOUT_S:g}s"
        ) from None
    except PenstockError as exc:
        raise ServiceUnavailableError(f"cannot generate: {exc.message}") from exc
    if generation.completion_tokens < 1:
        raise ServiceUnavailableError("cannot generate: the engine produced no token")
    return {"status": "ok", "weight_version": generation.weight_version}
