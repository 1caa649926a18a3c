"""What routes read from the app: the services :func:`penstock.app.factory.create_app` built.

They are attributes of ``app.state`` that ``create_app`` sets once, when the app's
lifespan starts; these functions give them their types.
"""

from __future__ import annotations

from fastapi import Request

from penstock.media.service import MediaService
from penstock.multimodal.inputs import MediaInputs
from penstock.rl.plane import AdminPlane


def admin_plane(request: Request) -> AdminPlane:
    plane: AdminPlane = request.app.state.admin_plane
    return plane


def media_inputs(request: Request) -> MediaInputs:
    """The loaders of media references in requests, on the server's one HTTP client."""
    inputs: MediaInputs = request.app.state.media_inputs
    return inputs


def media_service(request: Request) -> MediaService:
    service: MediaService = request.app.state.media
    return service
