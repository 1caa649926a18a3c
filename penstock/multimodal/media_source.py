"""Bytes of a media reference: a data URL, an http(s) URL fetched through
:mod:`penstock.http`, or a local file under an operator-allowed folder."""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote_to_bytes

from penstock.errors import (
    HttpConfigurationError,
    HttpError,
    HttpStatusError,
    HttpTimeoutError,
    UrlValidationError,
)
from penstock.http import HttpClient, UrlValidationPolicy, describe_media_source, env
from penstock.http.urls import check_scheme_and_size, local_path_of, validate_local_path


class _FromEnvironment:
    """A loader's limit left to the environment, read at each load."""

    def __repr__(self) -> str:
        return "FROM_ENVIRONMENT"


FROM_ENVIRONMENT = _FromEnvironment()
ByteLimit = int | None | _FromEnvironment


def load_rules(
    policy: UrlValidationPolicy | None, max_bytes: ByteLimit, *, honour_local_path: bool
) -> tuple[UrlValidationPolicy, int | None]:
    """The policy and download limit of one load. What the loader was not given is the
    environment's at this call (``DYN_MM_MAX_DATA_URL_MB``, ``DYN_MM_MAX_FILE_SIZE_MB``
    and the rest, as Dynamo's loaders read them at each call). The seed's
    ``allowed_local_path`` opens nothing unless ``honour_local_path``: Dynamo's loaders
    never read local files (the gateway's media, which reads them as Dynamo's frontend
    does, asks for it)."""
    if policy is None or isinstance(max_bytes, _FromEnvironment):
        from penstock.settings import Settings

        settings = Settings()
        if policy is None:
            policy = UrlValidationPolicy.from_settings(settings)
        if isinstance(max_bytes, _FromEnvironment):
            max_bytes = env.fetch_max_bytes(settings)
    if not honour_local_path and policy.allowed_local_path is not None:
        policy = replace(policy, allowed_local_path=None)
    return policy, max_bytes


@dataclass(frozen=True)
class MediaBytes:
    data: bytes
    # The media type a data URL declares; None for fetched and local media.
    mime: str | None = None


def decode_data_url(url: str, max_bytes: int | None = None) -> MediaBytes:
    """A base64 ``data:`` URL's payload, size-checked before and after decoding."""
    meta, comma, payload = url[5:].partition(",")
    if not comma:
        raise UrlValidationError("data URL has no ',' before its payload")
    params = [p.strip().lower() for p in meta.split(";")]
    if "base64" not in params[1:]:
        raise UrlValidationError("data URL must be base64-encoded (';base64,')")
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes + 2:
        raise UrlValidationError(f"data URL payload exceeds the {max_bytes} byte limit")
    try:
        data = base64.b64decode(unquote_to_bytes(payload), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UrlValidationError(f"data URL payload is not valid base64: {exc}") from exc
    if max_bytes is not None and len(data) > max_bytes:
        raise UrlValidationError(f"data URL payload exceeds the {max_bytes} byte limit")
    return MediaBytes(data, params[0] or "text/plain")


def _read_file(path: Path, max_bytes: int | None) -> bytes:
    with path.open("rb") as handle:
        data = handle.read(-1 if max_bytes is None else max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise UrlValidationError(f"local media file exceeds the {max_bytes} byte limit")
    return data


async def read_media(
    url: str,
    *,
    policy: UrlValidationPolicy,
    client: HttpClient,
    fetch_timeout_s: float,
    max_bytes: int | None,
) -> MediaBytes:
    """The bytes ``url`` names. Raises UrlValidationError for a refused reference, the
    ``HttpError`` family for a failed fetch."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("media URL is empty")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        check_scheme_and_size(url, policy)
        return decode_data_url(url, max_bytes)
    if scheme in ("http", "https"):
        return MediaBytes(
            await client.fetch_bytes(url, fetch_timeout_s, policy=policy, max_bytes=max_bytes)
        )
    path = local_path_of(url)
    if path is None:
        raise UrlValidationError(
            f"URL scheme '{scheme}' not allowed for media: {describe_media_source(url)}"
        )
    checked = validate_local_path(path, policy)
    return MediaBytes(await asyncio.to_thread(_read_file, checked, max_bytes))


async def fetch_media(
    url: str,
    what: str,
    *,
    policy: UrlValidationPolicy,
    client: HttpClient,
    fetch_timeout_s: float,
    max_bytes: int | None,
) -> MediaBytes:
    """:func:`read_media`, a failed fetch raised as what the client is told: 408 for a
    timeout, 400 for any other failure, naming ``what`` (``"the image"``). A refused
    reference, the host's own status and a deployment error pass through as they are."""
    try:
        return await read_media(
            url,
            policy=policy,
            client=client,
            fetch_timeout_s=fetch_timeout_s,
            max_bytes=max_bytes,
        )
    except (UrlValidationError, HttpStatusError, HttpConfigurationError):
        raise
    except HttpTimeoutError as exc:
        label = describe_media_source(url)
        raise HttpStatusError(408, f"Timed out fetching {what}: {exc}", label) from exc
    except HttpError as exc:
        label = describe_media_source(url)
        raise HttpStatusError(400, f"Could not fetch {what}: {exc}", label) from exc
