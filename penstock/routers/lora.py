"""LoRA adapter routes in vLLM's shape, and the adapter listing.

* ``POST /v1/load_lora_adapter {lora_name, lora_path}`` -> text ``Success: LoRA adapter
  '<name>' added successfully.``; ``lora_path`` is a local folder or a URI
  (``file://``, ``hf://`` from the local hub cache, ``s3://``, or a registered scheme).
  An engine without LoRA support -> 400; a name already loaded from elsewhere -> 409,
  unless ``load_inplace: true``: the adapter is then replaced in place (the folder read
  again, requests already running finish with the old adapter, see
  :mod:`penstock.lora.adapters`).
* ``POST /skyrl/v1/load_lora_adapter {lora_name, lora_path}`` (SkyRL's per-step reload)
  -> ``{"status": "ok", "lora_name", "lora_int_id"}``: always in place.
* ``POST /v1/unload_lora_adapter {lora_name}`` -> text ``Success: LoRA adapter '<name>'
  removed successfully.``; not loaded -> 404.
* ``GET /v1/loras`` -> ``{"status": "success", "loras": [{"lora_name", "lora_id",
  "local_path", "source"}], "count"}``.

A loaded adapter is also listed by ``GET /v1/models`` (with ``parent``: the base model)
and is used by any request whose ``model`` names it. Admin auth as in
:mod:`penstock.routers.admin`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from penstock.rl.fields import bool_field, json_object_body, required_str
from penstock.routers.deps import admin_plane
from penstock.routers.security import ADMIN_TAG, require_admin_key

router = APIRouter(tags=[ADMIN_TAG], dependencies=[Depends(require_admin_key)])


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await json_object_body(request)
    name = required_str(body, "lora_name")
    path = required_str(body, "lora_path")
    in_place = bool_field(body, "load_inplace", False)
    await admin_plane(request).adapters.load(name, path, field="lora_path", in_place=in_place)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/skyrl/v1/load_lora_adapter")
async def skyrl_load_lora_adapter(request: Request) -> dict[str, Any]:
    body = await json_object_body(request)
    name = required_str(body, "lora_name")
    path = required_str(body, "lora_path")
    adapter, _ = await admin_plane(request).adapters.load(
        name, path, field="lora_path", in_place=True
    )
    return {"status": "ok", "lora_name": name, "lora_int_id": adapter.info.id}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await json_object_body(request)
    name = required_str(body, "lora_name")
    await admin_plane(request).adapters.unload(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@router.get("/v1/loras")
async def list_loras(request: Request) -> dict[str, Any]:
    loras = admin_plane(request).adapters.listing()
    return {"status": "success", "loras": loras, "count": len(loras)}
