"""Screening of the unknown top-level fields a media request carries to its engine.

The gateway does not reject fields it does not know on media requests: engines grow knobs
faster than the API. Unknown fields are nested under ``extra_args["media_passthrough"]``
and screened here first, so that a client can never reach engine settings that name files,
repositories, remote locations or safety switches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from penstock.errors import MediaPassthroughRejected

MEDIA_PASSTHROUGH_KEY = "media_passthrough"

_REJECTED_KEYS = frozenset({"extra_args", "guardrails", "frame_interpolation_model_path"})
_REJECTED_FRAGMENTS = (
    "path",
    "checkpoint",
    "ckpt",
    "repo",
    "hub",
    "url",
    "uri",
    "local_dir",
    "guardrail",
    "safety",
    "nsfw",
    "moderation",
)


def is_rejected_key(key: str) -> bool:
    lowered = key.lower()
    return (
        key in _REJECTED_KEYS
        or key.startswith("_")
        or any(fragment in lowered for fragment in _REJECTED_FRAGMENTS)
    )


def screen_passthrough(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``knobs``, or :class:`MediaPassthroughRejected` naming every bad key."""
    rejected = [key for key in knobs if is_rejected_key(key)]
    if rejected:
        raise MediaPassthroughRejected(rejected)
    return dict(knobs)


def sanitize_media_passthrough(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The screened knobs of ``extra_args["media_passthrough"]`` (empty when absent)."""
    if not extra_args:
        return {}
    knobs = extra_args.get(MEDIA_PASSTHROUGH_KEY) or {}
    if not isinstance(knobs, Mapping):
        raise ValueError(f"extra_args.{MEDIA_PASSTHROUGH_KEY} must be an object")
    return screen_passthrough(knobs)


def nest_passthrough(
    extra_args: Mapping[str, Any] | None, unknown_fields: Mapping[str, Any]
) -> dict[str, Any] | None:
    """``extra_args`` with the screened ``unknown_fields`` under the passthrough key.

    None when there is nothing to carry, so no ``extra_args`` key appears on the wire.
    """
    merged = dict(extra_args or {})
    if unknown_fields:
        merged[MEDIA_PASSTHROUGH_KEY] = screen_passthrough(unknown_fields)
    return merged or None


ENDPOINT_TYPE_KEY = "endpoint_type"
"""The other key of ``extra_args`` the gateway sets on media requests: ``"videos"`` or
``"images"``, so one engine can serve both routes."""
