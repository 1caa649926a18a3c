"""Liveness and readiness, and vLLM's ``/ping`` and ``/load``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from penstock import __version__ as penstock_version

router = APIRouter(tags=["health"])

_STARTED = time.time()


@router.get("/live")
async def live() -> dict[str, object]:
    """200 while the process runs, whatever the engine is doing."""
    return {"status": "live", "message": "Service is live", "uptime": time.time() - _STARTED}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": penstock_version}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 only when new requests would be served now; else 503 with the state and reason."""
    gateway = request.app.state.gateway
    readiness = gateway.readiness()
    body: dict[str, object] = {
        "status": readiness.status,
        "uptime": time.time() - _STARTED,
        "models": sorted(m.name for m in gateway.listed_models()),
        "engine": {
            "state": gateway.host.state.value,
            "healthy": gateway.host.health.healthy,
            "last_check": gateway.host.health.checked_at,
        },
    }
    if readiness.reason:
        body["reason"] = readiness.reason
    if gateway.admin is not None:
        body["admin"] = gateway.admin.describe()
    if gateway.fleet is not None:
        body["fleet"] = gateway.fleet.describe_fleet()
    return JSONResponse(body, status_code=200 if readiness.ready else 503)


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> Response:
    """vLLM's (and SageMaker's) ping: an empty 200 when ``/health`` is 200, else 503."""
    ready = request.app.state.gateway.readiness().ready
    return Response(status_code=200 if ready else 503)


@router.get("/load")
async def load(request: Request) -> dict[str, int]:
    """vLLM's ``server_load``: the engine requests being served now, queued ones included."""
    gateway = request.app.state.gateway
    return {"server_load": round(sum(m.active.value for _, m in gateway.metrics.models()))}
