"""vLLM-shaped admin routes, for trainers that already speak vLLM's RL and dev routes.

Same process, same admin state machine and engine as ``/engine/*`` (see
:mod:`penstock.routers.admin` for auth, states and error statuses). Parameters travel in
the query string, as vLLM takes them, or in a JSON body (as SkyRL sends them); a field
in the query string wins over the same field in the body:

* ``POST /pause?mode=abort|wait|keep&clear_cache=false`` -> ``{"status": "paused", "mode"}``
* ``POST /resume`` -> ``{"status": "resumed"}``
* ``GET /is_paused`` -> ``{"is_paused": bool}``
* ``POST /sleep?level=1&mode=abort`` -> ``{"status": "sleeping", "level", "tags"}``
* ``POST /wake_up?tags=weights&tags=kv_cache`` (no tags: everything) -> ``{"status":
  "awake"}`` or ``{"status": "partially_awake", "is_sleeping": true, "tags": [still asleep]}``
* ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``
* ``POST /reset_prefix_cache`` -> ``{"status": "ok"}``
* ``POST /abort_requests {request_ids?}`` (missing or empty: all) -> ``{"status":
  "aborted", "aborted": <count>}``
* ``GET /weight_info`` -> ``{"weight_version"}``

LoRA (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) is in
:mod:`penstock.routers.lora`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from penstock.rl.fields import (
    bool_field,
    int_field,
    json_object_body,
    mode_field,
    str_list_field,
    tags_field,
)
from penstock.routers.deps import admin_plane
from penstock.routers.security import ADMIN_TAG, require_admin_key

router = APIRouter(tags=[ADMIN_TAG], dependencies=[Depends(require_admin_key)])


async def _params(request: Request, *, lists: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON body overlaid with the query string; query values are parsed as JSON
    scalars (``level=2`` is 2, ``clear_cache=true`` is True), ``lists`` repeat."""
    params = dict(await json_object_body(request))
    query = request.query_params
    for name in query:
        if name in lists:
            params[name] = query.getlist(name)
            continue
        raw = query[name]
        lowered = raw.lower()
        if lowered in ("true", "false"):
            params[name] = lowered == "true"
        elif raw.lstrip("-").isdigit():
            params[name] = int(raw)
        else:
            params[name] = raw
    return params


@router.post("/pause")
async def pause(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    params = await _params(request)
    checked = mode_field(params, "mode", "abort")
    await plane.state.pause(checked, bool_field(params, "clear_cache", False))
    return {"status": "paused", "mode": checked}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    await admin_plane(request).state.resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    return {"is_paused": admin_plane(request).state.is_paused}


@router.post("/sleep")
async def sleep(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    params = await _params(request, lists=("tags",))
    level = int_field(params, "level", 1, low=0, high=2)
    mode = mode_field(params, "mode", "abort")
    await plane.state.sleep(level, mode, tags_field(params))
    return {
        "status": "sleeping",
        "level": plane.state.sleep_level,
        "tags": sorted(plane.state.sleep_tags),
    }


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    params = await _params(request, lists=("tags",))
    await plane.state.wake_up(tags_field(params))
    if plane.state.is_sleeping:
        return {
            "status": "partially_awake",
            "is_sleeping": True,
            "tags": sorted(plane.state.sleep_tags),
        }
    return {"status": "awake"}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    return {"is_sleeping": admin_plane(request).state.is_sleeping}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    await admin_plane(request).state.run_control("flush_cache", {})
    return {"status": "ok"}


@router.post("/abort_requests")
async def abort_requests(request: Request) -> dict[str, Any]:
    plane = admin_plane(request)
    body = await json_object_body(request)
    ids = str_list_field(body, "request_ids")
    engine_body: dict[str, Any] = {"request_ids": ids} if ids else {"abort_all": True}
    result = await plane.state.run_control("abort_request", engine_body)
    return {"status": "aborted", "aborted": len(result.get("aborted", []))}


@router.get("/weight_info")
async def weight_info(request: Request) -> dict[str, Any]:
    return {"weight_version": admin_plane(request).state.weight_version}
