"""``/v1/models``: what clients may put in ``model``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from penstock.gateway import ServedModel

router = APIRouter(tags=["models"])


def model_card(model: ServedModel, name: str | None = None) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": name or model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "penstock",
    }
    if model.context_length is not None:
        card["context_window"] = model.context_length
    if model.lora_adapter is not None:
        card["parent"] = model.host.served_model_name
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    gateway = request.app.state.gateway
    return {
        "object": "list",
        "data": [model_card(model, name) for name, model in gateway.models.items()],
    }


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    return model_card(request.app.state.gateway.resolve(model_id), model_id)
