"""What routes read from the app: the services :func:`penstock.app.factory.create_app` built.

They are attributes of ``app.state`` that ``create_app`` sets once, when the app's
lifespan starts; these functions give them their types.
"""

from __future__ import annotations

from fastapi import Request

from penstock.media.records import NO_JOBS, JobRecords
from penstock.media.service import MediaService
from penstock.multimodal.inputs import MediaInputs
from penstock.responses.async_store import AsyncResponseStore
from penstock.rl.plane import AdminPlane


def admin_plane(request: Request) -> AdminPlane:
    plane: AdminPlane = request.app.state.admin_plane
    return plane


def media_inputs(request: Request) -> MediaInputs:
    """The loaders of media references in requests, on the server's one HTTP client."""
    inputs: MediaInputs = request.app.state.media_inputs
    return inputs


def media_jobs(request: Request) -> JobRecords:
    """The video jobs and stored images to look up: the media service's store, or, on a
    server whose models generate no media (it has no service), records that are always
    empty, so its media routes answer as over an empty store."""
    service: MediaService | None = request.app.state.media
    return NO_JOBS if service is None else service.jobs


def media_service(request: Request) -> MediaService:
    """The media service; routes ask for it only once they hold a job from
    :func:`media_jobs` or a model that generates media, which exist only where it does."""
    service: MediaService | None = request.app.state.media
    if service is None:
        raise RuntimeError("no media service: no served model generates media")
    return service


def response_store(request: Request) -> AsyncResponseStore:
    """The stored responses of the Responses API (opened on first use)."""
    store: AsyncResponseStore = request.app.state.responses
    return store
