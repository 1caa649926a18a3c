"""API-key checks. Inference keys and admin keys are separate sets; an admin key is
accepted on the inference routes too."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request

from penstock.errors import AuthenticationError, PermissionDeniedError
from penstock.media.records import Owner
from penstock.settings import Settings

ADMIN_TAG = "admin"


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_matches(token: str | None, keys: list[str]) -> bool:
    """Constant-time membership test."""
    if token is None:
        return False
    encoded = token.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(encoded, key.encode())
    return found


async def require_inference_key(request: Request) -> None:
    """App-wide dependency guarding every route with the inference keys.

    Skipped for paths in ``auth_exempt_paths`` and for admin routes, which check the admin
    keys themselves. No keys configured means open access. An admin key passes too (it is
    the stronger credential, and sees every caller's media jobs).
    """
    settings = request.app.state.gateway.settings
    if not settings.api_keys:
        return
    if is_admin_route(request.scope.get("route")):
        return
    check_inference_key(request, request.url.path, settings)


def is_admin_route(route: object) -> bool:
    """Tagged ``admin`` or guarded by :func:`require_admin_key` itself.

    The route is the one declared (FastAPI puts it in the scope), with its own router's
    tags and dependencies only: one included in an admin router declares the guard too.
    """
    if route is None:
        return False
    if ADMIN_TAG in (getattr(route, "tags", None) or []):
        return True
    dependencies = getattr(route, "dependencies", None) or []
    return any(dependency.dependency is require_admin_key for dependency in dependencies)


def check_inference_key(request: Request, path: str, settings: Settings) -> None:
    """:func:`require_inference_key`'s rule for a request to ``path`` of a route that is no
    admin route."""
    if not settings.api_keys or path in settings.auth_exempt_paths:
        return
    token = bearer_token(request)
    if token is None:
        raise AuthenticationError(
            "Missing API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not key_matches(token, settings.api_keys) and not key_matches(
        token, settings.admin_api_keys
    ):
        raise AuthenticationError("Invalid API key", headers={"WWW-Authenticate": "Bearer"})


def media_owner(request: Request, tag_of: Callable[[str], str]) -> Owner:
    """Whose media jobs and images the caller creates and sees.

    Admin keys see everyone's; each inference key its own and the shared ones; with no
    inference keys configured every caller is in the one shared scope. ``tag_of`` turns
    a key into the owner tag that is stored.
    """
    settings = request.app.state.gateway.settings
    token = bearer_token(request)
    if token is not None and key_matches(token, settings.admin_api_keys):
        return Owner(tag_of(token), sees_all=True)
    if token is not None and settings.api_keys:
        return Owner(tag_of(token))
    return Owner()


_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


async def require_admin_key(request: Request) -> None:
    """Dependency for admin routes (tag them ``admin`` too).

    With admin keys configured, the Bearer token must be one of them: none -> 401, any
    other token (an inference key included) -> 403. With no admin key configured, admin
    routes answer only clients on the loopback interface.
    """
    settings = request.app.state.gateway.settings
    if not settings.admin_api_keys:
        client = request.client.host if request.client else None
        if client not in _LOOPBACK_HOSTS:
            raise PermissionDeniedError(
                "Admin routes are loopback-only when no admin key is configured "
                "(set --admin-api-key / PENSTOCK_ADMIN_API_KEYS)"
            )
        return
    token = bearer_token(request)
    if token is None:
        raise AuthenticationError(
            "Missing admin key: send 'Authorization: Bearer <admin key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not key_matches(token, settings.admin_api_keys):
        raise PermissionDeniedError("This key may not use admin routes")
