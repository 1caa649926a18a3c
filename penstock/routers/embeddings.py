"""``POST /v1/embeddings`` (OpenAI), and vLLM's ``/classify`` and ``/pooling`` for the
reward and classification models RL scores rollouts with.

``/classify`` also takes SGLang's reward-model body (verl's ``reward_score``): ``{text |
input_ids, lora_path?, rid?, image_data: null}`` (a body naming ``text`` or
``input_ids`` and no ``input``) -> SGLang's answer, ``{"embedding": [the model's raw
scores], "index", "meta_info": {"id", "prompt_tokens"}}`` for one input, a list of them
for a batch; ``lora_path`` names the served model to use.

Served by a model whose engine pools (:mod:`penstock.engines.pooling`); any other model
gets 400 naming ``model``, as an embedding model does on the generation routes.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from penstock.errors import InvalidRequestError
from penstock.rl.fields import json_object_body
from penstock.schemas.embeddings import ClassificationRequest, EmbeddingRequest, PoolingRequest
from penstock.schemas.openai import NonNegativeInt
from penstock.schemas.unicode import RequestModel
from penstock.serving import embeddings as serving

router = APIRouter(tags=["embeddings"])
M = TypeVar("M", bound=BaseModel)


@router.post("/v1/embeddings", response_model=None)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    return JSONResponse(await serving.create_embeddings(request.app.state.gateway, body, request))


class SglangClassifyBody(RequestModel):
    """SGLang's ``EmbeddingReqInput`` as ``/classify`` reads it."""

    model_config = ConfigDict(extra="forbid")

    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: (
        Annotated[list[NonNegativeInt], Field(min_length=1)]
        | Annotated[list[list[NonNegativeInt]], Field(min_length=1)]
        | None
    ) = None
    image_data: None = None
    lora_path: str | None = None
    rid: str | list[str] | None = None


_CLASSIFY_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [
                        ClassificationRequest.model_json_schema(),
                        SglangClassifyBody.model_json_schema(),
                    ]
                }
            }
        },
    }
}


def _validated(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
        raise RequestValidationError(errors) from exc


@router.post("/classify", response_model=None, openapi_extra=_CLASSIFY_BODY)
async def classify_either(request: Request) -> JSONResponse:
    """vLLM's body, or SGLang's (it names ``text`` or ``input_ids``, never ``input``)."""
    body = await json_object_body(request)
    if "input" not in body and ("text" in body or "input_ids" in body):
        return JSONResponse(await _sglang_classify(_validated(SglangClassifyBody, body), request))
    return await classify(_validated(ClassificationRequest, body), request)


@router.post("/v1/classify", response_model=None)
async def classify(body: ClassificationRequest, request: Request) -> JSONResponse:
    return JSONResponse(await serving.classify(request.app.state.gateway, body, request))


async def _sglang_classify(body: SglangClassifyBody, request: Request) -> Any:
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError("send exactly one of 'text' and 'input_ids'", param="text")
    gateway = request.app.state.gateway
    model = body.lora_path or str(gateway.listed_models()[0].name)
    inputs: str | list[Any] = body.text if body.text is not None else body.input_ids or []
    vllm_body = ClassificationRequest(model=model, input=inputs, use_activation=False)
    answer = await serving.classify(gateway, vllm_body, request)
    single = isinstance(inputs, str) or not isinstance(inputs[0], (str, list))
    rids = body.rid if isinstance(body.rid, list) else [body.rid]
    results = []
    for item in answer["data"]:
        index = item["index"]
        rid = rids[index] if index < len(rids) and rids[index] else f"{answer['id']}-{index}"
        meta: dict[str, Any] = {"id": rid}
        if single:
            meta["prompt_tokens"] = answer["usage"]["prompt_tokens"]
        results.append({"embedding": item["probs"], "index": index, "meta_info": meta})
    return results[0] if single else results


@router.post("/pooling", response_model=None)
async def pooling(body: PoolingRequest, request: Request) -> JSONResponse:
    return JSONResponse(await serving.pooling(request.app.state.gateway, body, request))
