"""What routes read from the app: the services :func:`penstock.app.factory.create_app` built.

Both are attributes of ``app.state`` that ``create_app`` sets once, when the app's
lifespan starts; these functions give them their types.
"""

from __future__ import annotations

from fastapi import Request

from penstock.media.service import MediaService
from penstock.rl.plane import AdminPlane


def admin_plane(request: Request) -> AdminPlane:
    plane: AdminPlane = request.app.state.admin_plane
    return plane


def media_service(request: Request) -> MediaService:
    service: MediaService = request.app.state.media
    return service
