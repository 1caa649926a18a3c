"""API-key checks. Inference keys and admin keys are separate sets."""

from __future__ import annotations

import hmac

from fastapi import Request

from penstock.app.errors import AuthenticationError

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

    Skipped for paths in ``auth_exempt_paths`` and for admin routes (tag ``admin``), which
    check the admin keys themselves. No keys configured means open access.
    """
    settings = request.app.state.gateway.settings
    if not settings.api_keys or request.url.path in settings.auth_exempt_paths:
        return
    route = request.scope.get("route")
    if route is not None and ADMIN_TAG in (getattr(route, "tags", None) or []):
        return
    token = bearer_token(request)
    if token is None:
        raise AuthenticationError(
            "Missing API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not key_matches(token, settings.api_keys):
        raise AuthenticationError("Invalid API key", headers={"WWW-Authenticate": "Bearer"})
