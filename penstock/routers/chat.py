"""``POST /v1/chat/completions``.

Response extensions (all optional for OpenAI clients): ``weight_version`` on every
response and stream chunk (the engine weights that produced it); per choice
``weight_versions`` (``[{"weight_version", "start_token"}]``) in non-stream responses;
``prompt_token_ids`` and per-choice ``token_ids`` when ``return_token_ids`` is set.
A choice whose request was cancelled (client, admin pause in abort mode) finishes with
``finish_reason: "abort"``, as vLLM and SGLang report it.

This route is answered by :class:`penstock.app.hot.HotRoutes`, not FastAPI
(:mod:`penstock.routers.hot` lists it): FastAPI's parser, dependencies and error
handlers never run for it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from penstock.routers.deps import media_inputs
from penstock.schemas.openai import ChatCompletionRequest
from penstock.serving.chat import create_chat_completion as serve_chat_completion

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await serve_chat_completion(
        request.app.state.gateway, body, request, media_inputs(request)
    )
