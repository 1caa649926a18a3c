"""``/v1/models``: what clients may put in ``model``, each card in vLLM's shape (its
``root``, ``parent``, ``max_model_len`` and ``permission`` beside OpenAI's fields), since
clients of vLLM read them: TRL's client reads ``max_model_len``."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request

from penstock.gateway import ServedModel

router = APIRouter(tags=["models"])


def model_card(
    model: ServedModel, name: str | None = None, root: str | None = None
) -> dict[str, Any]:
    """``root``: where the served weights come from (the adapter's folder for a LoRA
    adapter, else the ``--model`` the server was started with)."""
    card: dict[str, Any] = {
        "id": name or model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "penstock",
        "root": model.lora_adapter or root or model.name,
        "parent": model.host.served_model_name if model.lora_adapter is not None else None,
        "max_model_len": model.context_length,
        "permission": [_permission(model.created)],
    }
    return card


def _permission(created: int) -> dict[str, Any]:
    """vLLM's permission entry: sampling, logprobs and viewing allowed, nothing else."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    gateway = request.app.state.gateway
    root = gateway.settings.model
    return {
        "object": "list",
        "data": [model_card(model, name, root) for name, model in gateway.models.items()],
    }


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    gateway = request.app.state.gateway
    return model_card(gateway.resolve(model_id), model_id, gateway.settings.model)
