"""LoRAManager: fetch LoRA adapters by URI into a local cache.

Seed parity: ``LoRAManager.register_custom_source`` and ``is_cached`` are the
``dynamo.common.lora`` API for code written against Dynamo; the gateway does not call them
itself (it only calls ``download_lora``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from penstock.lora.sources import (
    HfCacheSource,
    LocalSource,
    LoRASourceProtocol,
    S3Source,
    is_adapter_folder,
    not_an_adapter_message,
)

logger = logging.getLogger(__name__)

CACHE_ENV_VARS = ("PENSTOCK_LORA_CACHE", "DYN_LORA_PATH")


def default_cache_root() -> Path:
    """``PENSTOCK_LORA_CACHE``, else ``DYN_LORA_PATH``, else ``<home>/.cache/penstock/loras``."""
    for name in CACHE_ENV_VARS:
        value = os.environ.get(name, "").strip()
        if value:
            return Path(value)
    home = os.environ.get("HOME") or os.environ.get("USERPROFILE") or "/tmp"
    return Path(home) / ".cache" / "penstock" / "loras"


def uri_to_cache_key(lora_uri: str) -> str:
    """``s3://bucket/path/to/lora`` -> ``s3__bucket_path_to_lora``."""
    key = lora_uri.replace("://", "__")
    for char in ("/", "\\", "."):
        key = key.replace(char, "_")
    return key


@dataclass(frozen=True)
class LoRAInfo:
    """Metadata for a loaded LoRA adapter."""

    id: int
    path: str


class LoRAManager:
    """Resolves ``file://``, ``hf://`` and ``s3://`` URIs, plus registered custom schemes.

    ``download_lora`` never raises for a bad URI or a failed fetch: it returns
    ``{"status": "error", "message": ...}`` so callers can hand the reason to the client.
    """

    def __init__(self, cache_path: Path | None = None) -> None:
        self.cache_root = Path(cache_path) if cache_path is not None else default_cache_root()
        self._sources: dict[str, LoRASourceProtocol] = {
            "file": LocalSource(),
            "hf": HfCacheSource(),
            "s3": S3Source(),
        }
        self._key_locks: dict[str, asyncio.Lock] = {}

    def register_custom_source(self, scheme: str, source: LoRASourceProtocol) -> None:
        """Serve ``<scheme>://...`` URIs from ``source`` (replaces a built-in scheme too)."""
        scheme = scheme.removesuffix("://")
        if not scheme or "/" in scheme or ":" in scheme:
            raise ValueError(f"invalid URI scheme {scheme!r}: give it without '://'")
        if not isinstance(source, LoRASourceProtocol):
            raise TypeError("a LoRA source needs async download(uri, dest) and exists(uri)")
        self._sources[scheme] = source

    @property
    def schemes(self) -> list[str]:
        return sorted(self._sources)

    def get_cache_path(self, cache_key: str) -> Path:
        return self.cache_root / cache_key

    def is_cached(self, lora_uri: str) -> bool:
        """Check if LoRA is already cached locally."""
        return self.get_cache_path(uri_to_cache_key(lora_uri)).is_dir()

    @staticmethod
    def validate_cached(path: Path) -> bool:
        return is_adapter_folder(path)

    async def download_lora(self, lora_uri: str) -> dict[str, Any]:
        """Download the adapter if needed; ``{"status": "success", "local_path"}`` or an error."""
        try:
            local_path = await self._fetch(lora_uri)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("LoRA %s not loaded: %s", lora_uri, exc)
            return {"status": "error", "message": str(exc) or type(exc).__name__}
        return {"status": "success", "local_path": str(local_path)}

    async def _fetch(self, lora_uri: str) -> Path:
        scheme, sep, rest = lora_uri.partition("://")
        if not sep or not scheme or not rest:
            raise ValueError(f"LoRA URI must look like scheme://location, got '{lora_uri}'")
        source = self._sources.get(scheme)
        if source is None:
            raise ValueError(
                f"unsupported LoRA URI scheme '{scheme}' (supported: {', '.join(self.schemes)})"
            )
        key = uri_to_cache_key(lora_uri)
        lock = self._key_locks.setdefault(key, asyncio.Lock())
        async with lock:
            dest = self.get_cache_path(key)
            if self.validate_cached(dest):
                return dest
            if not await source.exists(lora_uri):
                raise FileNotFoundError(f"LoRA not found at {lora_uri}")
            path = Path(await source.download(lora_uri, dest))
            if not self.validate_cached(path):
                raise ValueError(not_an_adapter_message(lora_uri))
            return path
