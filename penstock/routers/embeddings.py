"""``POST /v1/embeddings`` (OpenAI), and vLLM's ``/classify`` and ``/pooling`` for the
reward and classification models RL scores rollouts with.

Served by a model whose engine pools (:mod:`penstock.engines.pooling`); any other model
gets 400 naming ``model``, as an embedding model does on the generation routes.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from penstock.schemas.embeddings import ClassificationRequest, EmbeddingRequest, PoolingRequest
from penstock.serving import embeddings as serving

router = APIRouter(tags=["embeddings"])


@router.post("/v1/embeddings", response_model=None)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    return JSONResponse(await serving.create_embeddings(request.app.state.gateway, body, request))


@router.post("/classify", response_model=None)
@router.post("/v1/classify", response_model=None)
async def classify(body: ClassificationRequest, request: Request) -> JSONResponse:
    return JSONResponse(await serving.classify(request.app.state.gateway, body, request))


@router.post("/pooling", response_model=None)
async def pooling(body: PoolingRequest, request: Request) -> JSONResponse:
    return JSONResponse(await serving.pooling(request.app.state.gateway, body, request))
