"""Embeddings, classification and pooling: validated inputs to one engine request, its
vectors to OpenAI's (or vLLM's) response.

The engine side is :mod:`penstock.engines.pooling`. Every input is checked here before the
engine sees any: none empty, at most :data:`MAX_INPUTS`, token ids inside the vocabulary,
none longer than the model's context. ``dimensions`` keeps the first N components of the
normalised embedding and normalises them again (what matryoshka models are trained for,
and what vLLM and OpenAI's ``text-embedding-3`` do); any N from 1 to the model's width is
accepted. ``base64`` is the vector as little-endian float32 bytes, as the ``openai`` client
decodes it.

Each request runs as a chat request does: under its deadline (``X-Request-Timeout``,
``--request-timeout-s``; a 408 once it passes, the engine request cancelled), cancelled
when the client leaves, through the engine's admission gate, and counted in the frontend
families (``endpoint`` ``embeddings``, ``classify`` or ``pooling``; no output tokens).
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from penstock.engines.context import Context
from penstock.engines.pooling import PoolingCapabilities, PoolingTask, pooling_capabilities
from penstock.errors import EngineError, InvalidRequestError
from penstock.gateway import Gateway, ServedModel
from penstock.schemas.embeddings import (
    ClassificationRequest,
    EmbeddingRequest,
    EncodingFormat,
    PoolingFields,
    PoolingRequest,
)
from penstock.serving.deadline import Deadline, request_deadline
from penstock.serving.framing import unless_disconnected
from penstock.serving.limits import check_prompt_length, check_token_ids, default_model_name
from penstock.serving.prompts import off_loop
from penstock.serving.request_metrics import RequestRecorder
from penstock.serving.requests import engine_context

# OpenAI's limit on the inputs of one embeddings request.
MAX_INPUTS = 2048

_SERVES = {"embed": "embeddings", "classify": "classification"}


@dataclass(frozen=True)
class Pooled:
    """The engine's answer to one request: a vector per input and the tokens it read."""

    vectors: list[list[float]]
    prompt_tokens: int


def _capabilities_of(served: ServedModel) -> PoolingCapabilities | None:
    if "embeddings" not in served.endpoint_types:
        return None
    config = served.host.engine_config
    return pooling_capabilities(config.runtime_data if config is not None else None)


def _not_served(served: ServedModel, name: str, task: PoolingTask) -> InvalidRequestError:
    offered = ", ".join(sorted(served.endpoint_types)) or "nothing"
    return InvalidRequestError(
        f"The model '{name}' does not serve {_SERVES[task]} (it serves: {offered})",
        param="model",
        code="model_not_supported",
    )


def _pooling_model(
    gateway: Gateway, name: str, task: PoolingTask
) -> tuple[ServedModel, PoolingCapabilities]:
    served = gateway.resolve(name)
    capabilities = _capabilities_of(served)
    if capabilities is None or task not in capabilities.tasks:
        raise _not_served(served, name, task)
    return served, capabilities


def _input_list(value: str | list[Any]) -> list[str] | list[list[int]]:
    """``input`` as a list of texts or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(item, int) for item in value):
        return [value]
    return value


async def _token_lists(
    gateway: Gateway, served: ServedModel, body: PoolingFields
) -> list[list[int]]:
    inputs = _input_list(body.input)
    if not inputs:
        raise InvalidRequestError("input must not be empty", param="input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(
            f"input holds {len(inputs)} items; at most {MAX_INPUTS} are allowed", param="input"
        )
    for number, item in enumerate(inputs):
        if len(item) == 0:
            raise InvalidRequestError(f"input[{number}] is empty", param="input")
    texts = [item for item in inputs if isinstance(item, str)]
    if texts:
        token_lists = await _tokenized(gateway, served, texts, body.add_special_tokens)
    else:
        token_lists = [item for item in inputs if isinstance(item, list)]
        for ids in token_lists:
            check_token_ids(ids, served, "input")
    context = served.context_length
    for number, ids in enumerate(token_lists):
        if context is not None and len(ids) > context:
            raise InvalidRequestError(
                f"input[{number}] has {len(ids)} tokens, more than the model's context of "
                f"{context}",
                param="input",
                code="context_length_exceeded",
            )
    return token_lists


async def _tokenized(
    gateway: Gateway, served: ServedModel, texts: list[str], special_tokens: bool
) -> list[list[int]]:
    pre = served.preprocessor
    if pre is None:
        raise InvalidRequestError(
            f"The model '{served.name}' has no tokenizer configured; send token ids",
            param="input",
        )
    for text in texts:
        check_prompt_length(gateway.settings, served, pre, len(text), "input")
    size = sum(len(text) for text in texts)
    if special_tokens:
        return await off_loop(gateway, None, size, pre.encode_inputs, texts)
    return [await off_loop(gateway, None, len(text), pre.encode, text) for text in texts]


async def _pool(
    gateway: Gateway,
    body: PoolingFields,
    task: PoolingTask,
    request: Request,
    served: ServedModel,
    endpoint: str,
) -> Pooled:
    """The request's vectors, under its deadline and cancelled if the client leaves."""
    deadline = request_deadline(request, gateway.settings)
    work = _pooled(gateway, body, task, request, served, endpoint, deadline)
    if deadline is None:
        return await unless_disconnected(request, work)
    try:
        return await unless_disconnected(request, deadline.within(work))
    finally:
        deadline.close()


async def _pooled(
    gateway: Gateway,
    body: PoolingFields,
    task: PoolingTask,
    request: Request,
    served: ServedModel,
    endpoint: str,
    deadline: Deadline | None,
) -> Pooled:
    token_lists = await _token_lists(gateway, served, body)
    engine_request = {"token_ids": token_lists, "model": served.name, "pooling_task": task}
    context = engine_context(request, user=body.user)
    recorder = RequestRecorder(gateway.metrics, served.name, sum(map(len, token_lists)))
    try:
        answer = await _answer(served, engine_request, context)
        recorder.succeeded()
    except BaseException as exc:
        recorder.failed(exc, deadline)
        raise
    finally:
        recorder.finish([], 0, 0, endpoint, False)
    vectors = answer.get("embeddings") if answer is not None else None
    if (
        answer is None
        or answer.get("finish_reason") != "stop"
        or not isinstance(vectors, list)
        or len(vectors) != len(token_lists)
    ):
        raise EngineError("the engine did not return one vector per input")
    prompt_tokens = int(answer.get("prompt_tokens") or sum(len(ids) for ids in token_lists))
    request.state.usage = lambda: _usage(prompt_tokens)
    return Pooled(vectors, prompt_tokens)


async def _answer(
    served: ServedModel, engine_request: dict[str, Any], context: Context
) -> dict[str, Any] | None:
    """The engine's terminal chunk."""
    answer: dict[str, Any] | None = None
    async for chunk in served.host.generate(engine_request, context):
        if chunk.get("finish_reason"):
            answer = chunk
    return answer


def _usage(prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def _normalised(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def _encoded(vector: list[float], encoding: EncodingFormat) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _check_dimensions(dimensions: int | None, capabilities: PoolingCapabilities) -> None:
    if dimensions is not None and not 1 <= dimensions <= capabilities.dimensions:
        raise InvalidRequestError(
            f"dimensions must be between 1 and {capabilities.dimensions} for this model; "
            f"got {dimensions}",
            param="dimensions",
        )


async def create_embeddings(
    gateway: Gateway, body: EmbeddingRequest, request: Request
) -> dict[str, Any]:
    """``POST /v1/embeddings``, answered as OpenAI does."""
    body.model = body.model or default_model_name(gateway)
    served, capabilities = _pooling_model(gateway, body.model, "embed")
    _check_dimensions(body.dimensions, capabilities)
    pooled = await _pool(gateway, body, "embed", request, served, "embeddings")
    vectors = pooled.vectors
    if body.dimensions is not None and body.dimensions < capabilities.dimensions:
        vectors = [_normalised(vector[: body.dimensions]) for vector in vectors]
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": _encoded(vector, body.encoding_format),
            }
            for index, vector in enumerate(vectors)
        ],
        "model": body.model,
        "usage": _usage(pooled.prompt_tokens),
    }


def activated(logits: list[float]) -> list[float]:
    """Class probabilities: a sigmoid for one class (a score), else a softmax."""
    if len(logits) == 1:
        # Written so that neither branch overflows for a logit far from zero.
        score = logits[0]
        if score >= 0:
            return [1.0 / (1.0 + math.exp(-score))]
        odds = math.exp(score)
        return [odds / (1.0 + odds)]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def _list_head(kind: str, model: str) -> dict[str, Any]:
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
    }


async def classify(
    gateway: Gateway, body: ClassificationRequest, request: Request
) -> dict[str, Any]:
    """vLLM's ``POST /classify``: per input the probabilities and the likeliest label."""
    body.model = body.model or default_model_name(gateway)
    served, capabilities = _pooling_model(gateway, body.model, "classify")
    pooled = await _pool(gateway, body, "classify", request, served, "classify")
    data = []
    for index, logits in enumerate(pooled.vectors):
        probs = activated(logits) if body.use_activation else logits
        best = max(range(len(logits)), key=logits.__getitem__)
        labels = capabilities.labels
        data.append(
            {
                "index": index,
                "label": labels[best] if best < len(labels) else None,
                "probs": probs,
                "num_classes": len(logits),
            }
        )
    return {
        **_list_head("classify", body.model),
        "data": data,
        "usage": _usage(pooled.prompt_tokens),
    }


async def pooling(gateway: Gateway, body: PoolingRequest, request: Request) -> dict[str, Any]:
    """vLLM's ``POST /pooling``: each input's pooled output, for the task the model serves."""
    body.model = body.model or default_model_name(gateway)
    served = gateway.resolve(body.model)
    capabilities = _capabilities_of(served)
    if capabilities is None:
        raise _not_served(served, body.model, body.task or "embed")
    task: PoolingTask = body.task or ("classify" if "classify" in capabilities.tasks else "embed")
    if task not in capabilities.tasks:
        raise InvalidRequestError(
            f"The model '{body.model}' does not serve the {task} task (it serves: "
            f"{', '.join(sorted(capabilities.tasks))})",
            param="task",
        )
    pooled = await _pool(gateway, body, task, request, served, "pooling")
    data = [
        {
            "index": index,
            "object": "pooling",
            "data": _encoded(
                activated(vector) if task == "classify" and body.use_activation else vector,
                body.encoding_format,
            ),
        }
        for index, vector in enumerate(pooled.vectors)
    ]
    return {**_list_head("pool", body.model), "data": data, "usage": _usage(pooled.prompt_tokens)}
