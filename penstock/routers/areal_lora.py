"""AReaL's LoRA broadcast to its vLLM servers (``areal/engine/vllm_remote.py``): the
trainer declares the adapter's tensors and LoRA settings, then broadcasts the tensors over
the group ``/areal_init_weights_update_group`` made.

* ``POST /areal_set_update_weight_meta_lora {names, dtypes, shapes, group_name, lora_name,
  lora_int_id, lora_target_modules, lora_rank, lora_alpha, lora_bias, base_model_name}``
  -> ``{"success": true, "message"}``: checked and kept for the next broadcast
* ``POST /areal_update_weights_lora_xccl`` (the same body, which AReaL repeats) -> the
  same: every declared tensor is received (one broadcast each, in ``names`` order), then
  the whole set is written as an adapter folder and loaded as ``lora_name``, in place
  when the name is loaded (:mod:`penstock.lora.adapters`: running requests finish with
  the adapter they began with). Each broadcast carries the whole adapter, as vLLM
  rebuilds it from each one.

A broadcast that breaks, or tensors that are not LoRA matrices of the served model,
load nothing: the adapter served before stays, and the answer is a 400 saying why.
AReaL names each step's adapter ``<name>-v<version>`` under one ``lora_int_id``; as vLLM
keeps one served name per adapter id, the name loaded before under that id (or the
adapter whose id it is, loaded from disk) is unloaded once the new one serves. Nothing
is paused: an adapter swap never changes a running request.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import ConfigDict, Field

from penstock.engines.weights.sync import WeightSyncError, lora_file_key
from penstock.errors import ConflictError, InvalidRequestError, PenstockError, clip
from penstock.lora.adapters import LoadedAdapters
from penstock.rl.fields import json_object_body
from penstock.routers.deps import admin_plane
from penstock.routers.security import ADMIN_TAG, require_admin_key
from penstock.schemas.fields import refuse_unknown
from penstock.schemas.unicode import JSONValue, RequestModel

admin_router = APIRouter(tags=[ADMIN_TAG], dependencies=[Depends(require_admin_key)])

logger = logging.getLogger(__name__)

_META = "areal_lora_meta"
# lora_int_id -> the served name AReaL's broadcast last loaded under it.
_NAMES = "areal_lora_names"


class LoraBroadcastMeta(RequestModel):
    """AReaL's ``UpdateWeightsFromXcclRequestLora``."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JSONValue] = Field(init=False)

    names: Annotated[list[str], Field(min_length=1)]
    dtypes: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: str
    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: int
    lora_target_modules: list[str] | str
    lora_rank: Annotated[int, Field(ge=1)]
    lora_alpha: Annotated[int, Field(ge=1)]
    # A trained bias would change the base model's own tensors, which no adapter may.
    lora_bias: Literal["none"]
    base_model_name: str


def _areal(message: str) -> dict[str, Any]:
    return {"success": True, "message": message}


def _served_model(request: Request) -> str:
    listed = request.app.state.gateway.listed_models()
    if not listed:
        raise InvalidRequestError("no model is being served", param="base_model_name")
    return str(listed[0].name)


@admin_router.post("/areal_set_update_weight_meta_lora", operation_id="areal_meta_lora")
async def areal_set_update_weight_meta_lora(
    body: LoraBroadcastMeta, request: Request
) -> dict[str, Any]:
    refuse_unknown(body, request.app.state.gateway.settings.allow_unknown_fields)
    for field in ("dtypes", "shapes"):
        if len(getattr(body, field)) != len(body.names):
            raise InvalidRequestError(
                f"{field} must have one entry per name ({len(body.names)})", param=field
            )
    for i, name in enumerate(body.names):
        try:
            lora_file_key(name)
        except WeightSyncError as exc:
            raise InvalidRequestError(str(exc), param=f"names[{i}]") from exc
    served = _served_model(request)
    if body.base_model_name != served:
        raise InvalidRequestError(
            f"base_model_name must be the served model {clip(repr(served))}",
            param="base_model_name",
        )
    if not admin_plane(request).adapters.supported:
        raise InvalidRequestError(
            "this engine does not support LoRA adapters", param="lora_name", code="lora_unsupported"
        )
    setattr(request.app.state, _META, body)
    return _areal(f"LoRA weight update meta set for {body.lora_name!r}")


@admin_router.post("/areal_update_weights_lora_xccl", operation_id="areal_lora_xccl")
async def areal_update_weights_lora_xccl(request: Request) -> dict[str, Any]:
    await json_object_body(request)
    meta: LoraBroadcastMeta | None = getattr(request.app.state, _META, None)
    if meta is None:
        raise ConflictError(
            "no LoRA tensors declared: POST /areal_set_update_weight_meta_lora first",
            code="invalid_state_transition",
        )
    plane = admin_plane(request)
    folder = Path(tempfile.mkdtemp(prefix="penstock-lora-"))
    try:
        await plane.state.run_update(
            "receive_lora_adapter",
            {
                "group_name": meta.group_name,
                "names": meta.names,
                "dtypes": meta.dtypes,
                "shapes": meta.shapes,
                "lora_config": {
                    "r": meta.lora_rank,
                    "lora_alpha": meta.lora_alpha,
                    "target_modules": meta.lora_target_modules,
                    "bias": meta.lora_bias,
                },
                "adapter_dir": str(folder),
            },
        )
        # The engine keeps the adapter it read in memory: the folder is not needed after.
        await plane.adapters.load(meta.lora_name, str(folder), field="names", in_place=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    await _retire_previous_name(request, plane.adapters, meta)
    return _areal(f"LoRA adapter {meta.lora_name!r} updated from {len(meta.names)} tensors")


async def _retire_previous_name(
    request: Request, adapters: LoadedAdapters, meta: LoraBroadcastMeta
) -> None:
    names: dict[int, str] | None = getattr(request.app.state, _NAMES, None)
    if names is None:
        names = {}
        setattr(request.app.state, _NAMES, names)
    previous = names.get(meta.lora_int_id) or next(
        (name for name, a in adapters.adapters.items() if a.info.id == meta.lora_int_id), None
    )
    names[meta.lora_int_id] = meta.lora_name
    if previous is None or previous == meta.lora_name or previous not in adapters.adapters:
        return
    try:
        await adapters.unload(previous)
    except PenstockError:
        # The new adapter serves either way; the old name stays listed until unloaded.
        logger.warning("LoRA adapter %r replaced by %r stays loaded", previous, meta.lora_name)
