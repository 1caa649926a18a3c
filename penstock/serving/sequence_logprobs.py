"""TRL's teacher logprobs (``POST /get_sequence_logprobs/``): per-token logprobs of
sequences the trainer already has, none generated.

``{"sequences": [[int]], "prompt_lengths": [int], "top_logprobs", "temperature",
"response_format": "json" | "binary"}``: for each sequence, every position from its
prompt length on gets the logprob of the sequence's own token and of the
``top_logprobs`` most likely ones, from ``log_softmax(logits / temperature)`` of one
forward pass over the sequence (the engine's prompt logprobs, see the contract's
``SUPPORTS_PROMPT_LOGPROBS``). Each sequence is one engine request generating one token
nobody reads, so every check of ``/v1/completions`` applies to it (vocabulary, context
length: a sequence must leave room for that token, admission).

``json`` -> ``{"logprobs": [[[float]]], "logprob_token_ids": [[[int]]]}``: per sequence,
per completion position, the sequence's token and the top ones by rank (the sequence's
token last when it is not among them; an empty list at position 0, which has no
logprob). ``binary`` -> float32 and int32 arrays, base64, of shape ``[sequences,
longest completion, top_logprobs]`` (``logprobs_b64``, ``token_ids_b64``: the top ones)
and ``[sequences, longest completion, 1]`` (``actual_logprobs_b64``,
``actual_token_ids_b64``: the sequence's own), padded with ``-inf`` and 0, with
``shape`` and ``completion_lengths``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from penstock.engines.contract import SUPPORTS_PROMPT_LOGPROBS
from penstock.errors import InvalidRequestError
from penstock.gateway import Gateway
from penstock.schemas.fields import refuse_unknown
from penstock.schemas.openai import CompletionRequest, NonNegativeInt
from penstock.schemas.unicode import JSONValue, RequestModel
from penstock.serving.choice import Delta
from penstock.serving.completions import completion_generations
from penstock.serving.deadline import request_deadline
from penstock.serving.generation import Generation
from penstock.serving.limits import engine_capability, served_model
from penstock.serving.stream import ResponsePlan, respond

if TYPE_CHECKING:
    import numpy as np

# vLLM's default ``max_logprobs``, which ``trl vllm-serve`` keeps.
MAX_TOP_LOGPROBS = 20

# Completions' names for the fields of this route.
_FIELD_NAMES = {"prompt": "sequences", "prompt_logprobs": "top_logprobs"}


class SequenceLogprobsBody(RequestModel):
    """The body TRL's ``VLLMClient.get_sequence_logprobs`` sends."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    sequences: Annotated[
        list[Annotated[list[NonNegativeInt], Field(min_length=1)]], Field(min_length=1)
    ]
    prompt_lengths: list[NonNegativeInt]
    top_logprobs: NonNegativeInt = 100
    temperature: Annotated[float, Field(gt=0, le=100)] = 1.0
    response_format: Literal["json", "binary"] = "json"


def _check_body(body: SequenceLogprobsBody) -> None:
    if body.top_logprobs > MAX_TOP_LOGPROBS:
        # TRL's client sends its default, 100, which vLLM refuses the same way.
        raise InvalidRequestError(
            f"top_logprobs must be at most {MAX_TOP_LOGPROBS} (vLLM's max_logprobs); "
            f"got {body.top_logprobs}",
            param="top_logprobs",
        )
    if len(body.prompt_lengths) != len(body.sequences):
        raise InvalidRequestError(
            f"prompt_lengths has {len(body.prompt_lengths)} entries for "
            f"{len(body.sequences)} sequences",
            param="prompt_lengths",
        )
    for i, (tokens, length) in enumerate(zip(body.sequences, body.prompt_lengths, strict=True)):
        if length > len(tokens):
            raise InvalidRequestError(
                f"prompt_lengths[{i}] is {length}, longer than sequences[{i}] "
                f"({len(tokens)} tokens)",
                param=f"prompt_lengths[{i}]",
            )


async def sequence_logprobs(
    gateway: Gateway, body: SequenceLogprobsBody, model: str, request: Request
) -> Response:
    """Score ``body``'s sequences on ``model`` and answer in TRL's shape."""
    refuse_unknown(body, gateway.settings.allow_unknown_fields)
    _check_body(body)
    completion = CompletionRequest(
        model=model,
        prompt=body.sequences,
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=body.top_logprobs,
    )
    served = served_model(gateway, completion, "completions", "generate")
    if not engine_capability(served, SUPPORTS_PROMPT_LOGPROBS):
        raise InvalidRequestError(
            f"the engine of model '{model}' reports no prompt logprobs, which sequence "
            "logprobs are",
            param="sequences",
            code="unsupported_parameter",
        )
    deadline = request_deadline(request, gateway.settings)
    try:
        _, generations = await completion_generations(
            gateway, completion, request, deadline, "generate"
        )
    except InvalidRequestError as exc:
        if exc.param is not None:
            head, dot, rest = exc.param.partition("[")
            exc.param = _FIELD_NAMES.get(head, head) + dot + rest
        raise
    if body.temperature != 1.0:
        for generation in generations:
            generation.request["output_options"]["prompt_logprobs_temperature"] = body.temperature
    fmt = SequenceLogprobsFormat(body)
    return await respond(request, ResponsePlan(fmt, generations, completion, None, deadline))


class SequenceLogprobsFormat:
    """TRL's answer, once every sequence's prompt logprobs are in."""

    id_prefix = "seqlp-"
    chunk_object = "sequence_logprobs"
    response_object = "sequence_logprobs"

    def __init__(self, body: SequenceLogprobsBody) -> None:
        self.body = body

    def prelude(self, generations: Sequence[Generation]) -> list[dict[str, Any]]:
        return []

    def chunk_choice(self, delta: Delta) -> dict[str, Any] | None:
        return None

    async def finished(self, generations: Sequence[Generation]) -> dict[str, Any]:
        ranked = [
            [
                None if entries is None else sorted(entries, key=lambda entry: entry["rank"])
                for entries in (generation.prompt_logprobs or [])[length:]
            ]
            for generation, length in zip(generations, self.body.prompt_lengths, strict=True)
        ]
        if self.body.response_format == "binary":
            body = self.body
            return _binary(ranked, body.sequences, body.prompt_lengths, body.top_logprobs)
        return {
            "logprobs": [
                [[e["logprob"] for e in entries or []] for entries in positions]
                for positions in ranked
            ],
            "logprob_token_ids": [
                [[e["token_id"] for e in entries or []] for entries in positions]
                for positions in ranked
            ],
        }


def _binary(
    ranked: list[list[list[dict[str, Any]] | None]],
    sequences: list[list[int]],
    prompt_lengths: list[int],
    top: int,
) -> dict[str, Any]:
    # Imported here: a server answering only JSON keeps numpy out of its memory.
    import numpy as np

    lengths = [len(positions) for positions in ranked]
    shape = [len(ranked), max(lengths, default=0), top]
    values = np.full(shape, -np.inf, dtype=np.float32)
    ids = np.zeros(shape, dtype=np.int32)
    actual_values = np.full([*shape[:2], 1], -np.inf, dtype=np.float32)
    actual_ids = np.zeros([*shape[:2], 1], dtype=np.int32)
    for i, positions in enumerate(ranked):
        for t, entries in enumerate(positions):
            if entries is None:
                continue
            token = sequences[i][prompt_lengths[i] + t]
            actual_ids[i, t, 0] = token
            for entry in entries:
                if entry["token_id"] == token:
                    actual_values[i, t, 0] = entry["logprob"]
            best = entries[:top]
            values[i, t, : len(best)] = [entry["logprob"] for entry in best]
            ids[i, t, : len(best)] = [entry["token_id"] for entry in best]
    return {
        "logprobs_b64": _b64(values),
        "token_ids_b64": _b64(ids),
        "actual_logprobs_b64": _b64(actual_values),
        "actual_token_ids_b64": _b64(actual_ids),
        "shape": shape,
        "completion_lengths": lengths,
    }


def _b64(array: np.ndarray[Any, Any]) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")
