"""``POST /v1/completions``: string, strings, token ids or lists of token ids.

A batch of prompts runs as one engine request per prompt, concurrently; choice ``index``
is ``prompt_index * n + choice``. Response extensions as for chat, and, as chat, this
route is answered by :class:`penstock.app.hot.HotRoutes`, not FastAPI (see
:mod:`penstock.routers.chat` and :mod:`penstock.routers.hot`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from penstock.schemas.openai import CompletionRequest
from penstock.serving.completions import create_completion as serve_completion

router = APIRouter(tags=["openai"])


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await serve_completion(request.app.state.gateway, body, request)
