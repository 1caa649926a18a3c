"""``POST /v1/responses`` and the stored responses: ``GET`` / ``DELETE /v1/responses/{id}``
and ``GET /v1/responses/{id}/input_items``.

Stored responses belong to the caller's key as media jobs do
(:func:`penstock.routers.security.media_owner`): another key's response is not found
(404), an admin key sees them all. The store opens on the first request that needs it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from penstock.errors import NotFoundError
from penstock.media.records import Owner
from penstock.responses.records import StoredResponse
from penstock.routers.deps import media_inputs, response_store
from penstock.routers.security import media_owner
from penstock.schemas.responses import ResponsesRequest
from penstock.serving.responses import create_response as serve_response

router = APIRouter(tags=["openai"])


async def _owner(request: Request) -> Owner:
    return media_owner(request, await response_store(request).tagger())


async def _stored_or_404(request: Request, response_id: str) -> StoredResponse:
    found = await response_store(request).get(response_id, await _owner(request))
    if found is None:
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return found


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    # The store is opened only for a request that reads or writes it.
    owner = await _owner(request) if body.store or body.previous_response_id else None
    return await serve_response(
        request.app.state.gateway,
        body,
        request,
        media_inputs(request),
        response_store(request),
        owner,
    )


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    return (await _stored_or_404(request, response_id)).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not await response_store(request).delete(response_id, await _owner(request)):
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """The input items the response was given, newest first unless ``order=asc``."""
    items = (await _stored_or_404(request, response_id)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise NotFoundError(f"No input item with id '{after}'", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
