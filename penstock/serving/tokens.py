"""Token-in/token-out generation in the shapes RL trainers read: vLLM's
``/inference/v1/generate`` and TRL's ``trl vllm-serve`` ``/generate/``.

Both take vLLM's sampling fields (``sampling_params``; TRL's top-level fields and its
``generation_kwargs``) and run on the completions path (:func:`completion_generations`),
so every check and limit of ``/v1/completions`` applies. A vLLM sampling field this
server cannot honour is a 400 naming it under its parent (``sampling_params.use_beam_search``),
as is a field vLLM does not define under ``--no-allow-unknown-fields`` (by default it is
ignored and named in the ``x-penstock-ignored-fields`` header).

vLLM: ``{"token_ids", "sampling_params", "model"?, "cache_salt"?}`` ->
``{"request_id", "choices": [{"index", "token_ids", "finish_reason", "logprobs":
{"content": [{"token", "logprob", "bytes", "top_logprobs"}]} | null}],
"prompt_logprobs", "kv_transfer_params": null, "weight_version"}``; ``prompt_logprobs`` is
null unless ``sampling_params.prompt_logprobs`` asks for them, then vLLM's list (None,
then per prompt token ``{token_id: {"logprob", "rank", "decoded_token"}}``, the prompt's
token first; they are not streamed); with ``stream``,
one ``data: {"request_id", "choices": [{"index", "token_ids", "finish_reason", "logprobs"}],
"weight_version"}`` event per engine output that adds tokens or ends a choice (the new
tokens only), ``{"request_id", "choices": [], "usage"}`` last with
``stream_options.include_usage``, then ``data: [DONE]``.

SkyRL (``/skyrl/v1/generate``): vLLM's body and answer, each choice with its
``routed_experts`` as SkyRL packs them (``{"data": base64, "shape": [tokens, layers,
top_k], "dtype"}``, the smallest of ``uint8``, ``int16``, ``int32`` that holds every
index), from engines declaring ``SUPPORTS_ROUTED_EXPERTS``; not streamed.

TRL: ``{"prompts": [str] | [[int]], "n", "temperature", "top_p", "top_k", "min_p",
"repetition_penalty", "max_tokens", "logprobs", "generation_kwargs"}`` ->
``{"prompt_ids", "completion_ids", "logprobs", "logprob_token_ids"}``: per completion,
per token, the sampled token first when ``logprobs`` is 0, else the ``logprobs`` most
likely and the sampled one, by descending logprob; ``generation_kwargs.prompt_logprobs``
is a 400, TRL's answer having no place for them.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from penstock.engines.contract import SUPPORTS_ROUTED_EXPERTS
from penstock.errors import InvalidRequestError, clip
from penstock.gateway import Gateway, ServedModel
from penstock.schemas.fields import refuse_or_ignore
from penstock.schemas.openai import CompletionRequest
from penstock.serving.choice import ChoiceState, Delta, LogprobEntry
from penstock.serving.completions import completion_generations, vllm_prompt_logprobs
from penstock.serving.deadline import request_deadline
from penstock.serving.framing import JSONObject
from penstock.serving.generation import Generation
from penstock.serving.limits import engine_capability
from penstock.serving.sse import data_frame
from penstock.serving.stream import ResponsePlan, respond

# Fields of vLLM's ``SamplingParams`` that completions does not declare, each with the
# value that asks for nothing.
_SAMPLING_ONLY: dict[str, Any] = {
    "detokenize": True,
    "output_kind": None,
    "extra_args": None,
    "flat_logprobs": False,
}
_DECLARED = frozenset(CompletionRequest.model_fields) - {"prompt", "model", "stream"}


def sampling_request(
    params: Mapping[str, Any],
    parent: str,
    allow_unknown: bool,
    **fields: Any,
) -> CompletionRequest:
    """vLLM's sampling fields ``params`` (found under ``parent``) with ``fields`` as one
    completions request; a field refused is named under ``parent``."""
    unsupported = {**CompletionRequest.unsupported, **_SAMPLING_ONLY}
    taken: dict[str, Any] = {}
    unknown: list[str] = []
    for name, value in params.items():
        if name in _DECLARED:
            taken[name] = value
        elif name in unsupported:
            if value is not None and value != unsupported[name]:
                raise InvalidRequestError(
                    f"{parent}.{name} is not supported by this server; got {clip(repr(value))}",
                    param=f"{parent}.{name}",
                    code="unsupported_parameter",
                )
        else:
            unknown.append(f"{parent}.{name}")
    refuse_or_ignore(unknown, allow_unknown)
    try:
        return CompletionRequest.model_validate({**taken, **fields})
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"]]
        where = ".".join(loc if loc and loc[0] in fields else [parent, *loc])
        raise InvalidRequestError(
            f"{where}: {error['msg']}", param=where, code="invalid_value"
        ) from exc


async def run_tokens(
    gateway: Gateway, body: CompletionRequest, request: Request, shape: str
) -> Response:
    """Generate ``body`` and answer in ``shape`` (``vllm``, ``skyrl`` or ``trl``)."""
    if shape == "trl" and body.prompt_logprobs is not None:
        raise InvalidRequestError(
            "generation_kwargs.prompt_logprobs: TRL's answer has no place for prompt logprobs",
            param="generation_kwargs.prompt_logprobs",
            code="unsupported_parameter",
        )
    if shape == "skyrl":
        _check_routed_experts(gateway, body)
    deadline = request_deadline(request, gateway.settings)
    try:
        model, generations = await completion_generations(
            gateway, body, request, deadline, "generate"
        )
    except InvalidRequestError as exc:
        # The completions check names the field where completions has it.
        if exc.param == "prompt_logprobs" and shape != "trl":
            exc.param = "sampling_params.prompt_logprobs"
        raise
    fmt: VllmTokensFormat | TrlFormat
    if shape == "trl":
        fmt = TrlFormat(generations, body.logprobs)
    elif shape == "skyrl":
        for generation in generations:
            generation.request["output_options"]["return_routed_experts"] = True
        fmt = SkyrlFormat(model)
    else:
        fmt = VllmTokensFormat(model)
    return await respond(request, ResponsePlan(fmt, generations, body, None, deadline))


class VllmTokensFormat:
    """vLLM's ``GenerateResponse``: the token ids and logprobs of each choice."""

    id_prefix = "gen-"
    chunk_object = "generate"
    response_object = "generate"

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        return []

    def encoder(self, plan: ResponsePlan) -> VllmTokensEvents:
        return VllmTokensEvents(plan.response_id)

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        if not delta.token_ids and delta.finish_reason is None:
            return None
        return {
            "index": delta.choice.index,
            "token_ids": delta.token_ids,
            "finish_reason": delta.finish_reason,
            "logprobs": {"content": self._content(delta.logprobs)}
            if delta.logprobs is not None
            else None,
        }

    def _token(self, token_id: int) -> str:
        pre = self.model.preprocessor
        return pre.token_text(token_id) if pre is not None else f"token_id:{token_id}"

    def _content(self, entries: list[LogprobEntry]) -> list[dict[str, Any]]:
        return [
            {
                "token": self._token(entry.token_id),
                "logprob": entry.logprob,
                "bytes": None,
                "top_logprobs": [
                    {"token": self._token(alt.token_id), "logprob": alt.logprob, "bytes": None}
                    for alt in entry.top
                ],
            }
            for entry in entries
        ]

    def response_choice(self, generation: Generation, choice: ChoiceState) -> dict[str, Any]:
        return {
            "index": choice.index,
            "token_ids": list(choice.token_ids),
            "finish_reason": choice.finish_reason,
            "logprobs": {"content": self._content(choice.logprobs)}
            if choice.logprobs is not None
            else None,
        }

    def response_fields(self, generations: Sequence[Generation]) -> dict[str, Any]:
        return {"prompt_logprobs": vllm_prompt_logprobs(self.model, generations[0].prompt_logprobs)}

    def reshape(self, response: dict[str, Any]) -> dict[str, Any]:
        return {
            "request_id": response["id"],
            "choices": response["choices"],
            "prompt_logprobs": response["prompt_logprobs"],
            "kv_transfer_params": None,
            "weight_version": response["weight_version"],
        }


def _check_routed_experts(gateway: Gateway, body: CompletionRequest) -> None:
    model = gateway.resolve(body.model)
    if not engine_capability(model, SUPPORTS_ROUTED_EXPERTS):
        raise InvalidRequestError(
            f"routed_experts are not supported by the model '{body.model}': its engine "
            "records no expert routing (the transformers engine does, under --deterministic, "
            "for a mixture-of-experts model); generate at /inference/v1/generate instead",
            param="routed_experts",
            code="unsupported_parameter",
        )
    if body.stream:
        raise InvalidRequestError(
            "routed_experts are not streamed: send the request without stream", param="stream"
        )


class SkyrlFormat(VllmTokensFormat):
    """``/skyrl/v1/generate``: vLLM's answer, each choice with its packed routed experts."""

    def response_choice(self, generation: Generation, choice: ChoiceState) -> dict[str, Any]:
        routes = generation.routed_experts.get(generation.choices.index(choice))
        return {
            **super().response_choice(generation, choice),
            "routed_experts": None if routes is None else pack_routed_experts(routes),
        }


def pack_routed_experts(routes: list[Any]) -> dict[str, Any]:
    """SkyRL's packing: the indices as one C-order array of the smallest integer type
    that holds them all, base64."""
    # Imported here: a server answering no routed experts keeps numpy out of its memory.
    import numpy as np

    array = np.asarray(routes, dtype=np.int64)
    if array.ndim != 3:
        array = array.reshape(0, 0, 0)
    top = int(array.max(initial=0))
    dtype = np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32
    packed = np.ascontiguousarray(array, dtype=dtype)
    return {
        "data": base64.b64encode(packed.tobytes()).decode("ascii"),
        "shape": list(packed.shape),
        "dtype": packed.dtype.name,
    }


class VllmTokensEvents:
    """The stream events of vLLM's ``/inference/v1/generate``: no ``object`` or ``model``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def frame(
        self, choices: list[JSONObject], weight_version: str | None, usage: JSONObject | None = None
    ) -> bytes:
        event: dict[str, Any] = {"request_id": self.request_id, "choices": choices}
        if weight_version is not None:
            event["weight_version"] = weight_version
        if usage is not None:
            event["usage"] = usage
        return data_frame(orjson.dumps(event))


class TrlFormat:
    """TRL's ``/generate/`` answer: prompt and completion ids, logprobs per token."""

    id_prefix = "gen-"
    chunk_object = "generate"
    response_object = "generate"

    def __init__(self, generations: Sequence[Generation], logprobs: int | None) -> None:
        self.generations = generations
        self.logprobs = logprobs

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        return []

    def chunk_choice(self, delta: Any) -> dict[str, Any] | None:
        return None

    def _ranked(self, entry: LogprobEntry) -> list[tuple[float, int]]:
        sampled = (entry.logprob, entry.token_id)
        if not self.logprobs:
            return [sampled]
        ranked = [(alt.logprob, alt.token_id) for alt in entry.top[: self.logprobs]]
        if all(token != entry.token_id for _, token in ranked):
            ranked.append(sampled)
        return sorted(ranked, key=lambda pair: -pair[0])

    def response_choice(self, generation: Generation, choice: ChoiceState) -> dict[str, Any]:
        ranked = [self._ranked(entry) for entry in choice.logprobs or []]
        return {
            "completion_ids": list(choice.token_ids),
            "logprobs": [[logprob for logprob, _ in pairs] for pairs in ranked],
            "logprob_token_ids": [[token for _, token in pairs] for pairs in ranked],
        }

    def response_fields(self, generations: Sequence[Generation]) -> dict[str, Any]:
        return {}

    def reshape(self, response: dict[str, Any]) -> dict[str, Any]:
        choices = response["choices"]
        with_logprobs = self.logprobs is not None
        return {
            "prompt_ids": [list(g.request["token_ids"]) for g in self.generations],
            "completion_ids": [c["completion_ids"] for c in choices],
            "logprobs": [c["logprobs"] for c in choices] if with_logprobs else None,
            "logprob_token_ids": [c["logprob_token_ids"] for c in choices]
            if with_logprobs
            else None,
        }
