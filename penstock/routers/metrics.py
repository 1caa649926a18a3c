"""``GET /metrics``: the gateway's metrics plus whatever the engine bridges in, or under
``--ray`` every replica's (labelled ``replica``) and the ingress's view of each."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gateway = request.app.state.gateway
    text = generate_latest(gateway.metrics.registry) + gateway.engine_metrics.render().encode()
    if gateway.fleet is not None:
        text += (await gateway.fleet.metrics_text()).encode()
    return Response(text, media_type=CONTENT_TYPE_LATEST)
