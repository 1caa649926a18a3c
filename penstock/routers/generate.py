"""SGLang's ``POST|PUT /generate`` (token-in/token-out) and ``GET /health_generate``.

Inference routes: the inference keys guard them like ``/v1/completions``. Bodies and
responses are documented in :mod:`penstock.serving.generate`. ``/health_generate`` answers
200 ``{"status": "ok", "weight_version"}`` after a one-token generation, and 503 when the
engine cannot generate now (paused, asleep, draining, unhealthy, or no token in time).

``/generate`` is answered by :class:`penstock.app.hot.HotRoutes`, not FastAPI
(:mod:`penstock.routers.hot` lists it): FastAPI's parser, dependencies and error
handlers never run for it.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from penstock.errors import ServiceUnavailableError
from penstock.serving.generate import GenerateBody
from penstock.serving.generate import generate as serve_generate
from penstock.serving.generate import health_generate as serve_health_generate

logger = logging.getLogger(__name__)
router = APIRouter(tags=["sglang"])


# One route per method, each with its own OpenAPI operation id (SGLang accepts both).
@router.post("/generate", response_model=None, operation_id="generate_post")
@router.put("/generate", response_model=None, operation_id="generate_put")
async def generate(body: GenerateBody, request: Request) -> Response:
    return await serve_generate(request.app.state.gateway, body, request)


@router.get("/health_generate", response_model=None)
async def health_generate(request: Request) -> dict[str, Any] | Response:
    try:
        return await serve_health_generate(request.app.state.gateway, request)
    except ServiceUnavailableError as exc:
        # Expected while paused, asleep or draining: a warning, not a failed request.
        logger.warning("health_generate: %s", exc.message)
        return Response(
            orjson.dumps(exc.envelope()),
            status_code=exc.status_code,
            media_type="application/json",
            headers=exc.headers or None,
        )
