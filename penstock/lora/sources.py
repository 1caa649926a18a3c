"""Where LoRA adapters come from: a local folder, the local Hugging Face cache, or S3."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from penstock.extras import S3_INSTALL
from penstock.lora.once import OnceLock

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHT_FILES = (
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.lora_weights.npy",
)


@runtime_checkable
class LoRASourceProtocol(Protocol):
    """Protocol for custom Python LoRA sources. Users can implement this to add sources."""

    async def download(self, lora_uri: str, dest_path: Path) -> Path:
        """Download LoRA to dest_path, return the actual path."""
        ...

    async def exists(self, lora_uri: str) -> bool:
        """Check if LoRA exists in this source."""
        ...


def is_adapter_folder(path: Path) -> bool:
    """An adapter folder has its config and one weight file in a known format."""
    if not (path / ADAPTER_CONFIG).is_file():
        return False
    return any((path / name).is_file() for name in ADAPTER_WEIGHT_FILES)


def not_an_adapter_message(where: str) -> str:
    return (
        f"{where} is not a LoRA adapter: it needs {ADAPTER_CONFIG} and one of "
        f"{', '.join(ADAPTER_WEIGHT_FILES)}"
    )


class LocalSource:
    """``file:///abs/path``: the adapter folder is used where it is, never copied."""

    @staticmethod
    def path_of(lora_uri: str) -> Path:
        parts = urlsplit(lora_uri)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URI must name a local path, got host '{parts.netloc}'")
        return Path(unquote(parts.path))

    async def exists(self, lora_uri: str) -> bool:
        return self.path_of(lora_uri).is_dir()

    async def download(self, lora_uri: str, dest_path: Path) -> Path:
        return self.path_of(lora_uri)


def hf_hub_cache_dir() -> Path:
    """The hub cache as Hugging Face resolves it, read now (tests and operators set env)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit)
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


class HfCacheSource:
    """``hf://org/repo[@revision]`` served from the local hub cache only.

    This process never downloads from the hub: an adapter that is not already in the
    cache is an error that says so and where the cache is.
    """

    @staticmethod
    def repo_of(lora_uri: str) -> tuple[str, str | None]:
        spec = lora_uri.split("://", 1)[1].strip("/")
        repo_id, _, revision = spec.partition("@")
        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise ValueError(f"hf URI must look like hf://org/repo[@revision], got '{lora_uri}'")
        return repo_id, revision or None

    def _snapshot(self, lora_uri: str) -> Path | None:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        repo_id, revision = self.repo_of(lora_uri)
        try:
            folder = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hf_hub_cache_dir(),
                local_files_only=True,
            )
        except LocalEntryNotFoundError:
            return None
        return Path(str(folder))

    async def exists(self, lora_uri: str) -> bool:
        return await asyncio.to_thread(self._snapshot, lora_uri) is not None

    async def download(self, lora_uri: str, dest_path: Path) -> Path:
        folder = await asyncio.to_thread(self._snapshot, lora_uri)
        if folder is None:
            raise FileNotFoundError(
                f"{lora_uri} is not in the local Hugging Face cache ({hf_hub_cache_dir()}); "
                "this server does not download from the hub"
            )
        return folder


class S3Source:
    """``s3://bucket/prefix``: every object under the prefix, fetched through fsspec's s3fs
    (the ``s3`` extra, imported on first use), the stack s3:// media stores and metadata
    uploads use too.

    The filesystem is built on first use from the usual AWS environment (credentials,
    region, ``AWS_ENDPOINT_URL`` for S3-compatible stores) unless one is given.
    """

    def __init__(self, filesystem: Any = None) -> None:
        self._filesystem: OnceLock[Any] = OnceLock()
        if filesystem is not None:
            self._filesystem.get_or_init(lambda: filesystem)

    def filesystem(self) -> Any:
        def build() -> Any:
            import fsspec

            try:
                # Not fsspec's shared instance: that one keeps the environment of its day.
                return fsspec.filesystem("s3", skip_instance_cache=True)
            except ImportError as exc:
                raise ImportError(
                    f"s3:// LoRA adapters need s3fs, which is not installed: {S3_INSTALL}"
                ) from exc

        return self._filesystem.get_or_init(build)

    @staticmethod
    def location_of(lora_uri: str) -> str:
        """``bucket/prefix/`` of ``lora_uri``, as s3fs names it."""
        parts = urlsplit(lora_uri)
        bucket, prefix = parts.netloc, parts.path.strip("/")
        if not bucket or not prefix:
            raise ValueError(f"s3 URI must look like s3://bucket/prefix, got '{lora_uri}'")
        return f"{bucket}/{prefix}/"

    def _keys(self, location: str) -> list[str]:
        return [key for key in self.filesystem().find(location) if key.startswith(location)]

    async def exists(self, lora_uri: str) -> bool:
        return bool(await asyncio.to_thread(self._keys, self.location_of(lora_uri)))

    def _download(self, lora_uri: str, dest_path: Path) -> Path:
        location = self.location_of(lora_uri)
        dest_path.parent.mkdir(parents=True, exist_ok=True)
        # Fetch into a sibling temp folder and rename, so a half-downloaded adapter is
        # never mistaken for a cached one.
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=dest_path.parent))
        try:
            for key in self._keys(location):
                relative = PurePosixPath(key[len(location) :])
                if not relative.parts:
                    continue
                if ".." in relative.parts:
                    raise ValueError(f"refusing S3 key outside the adapter prefix: {key}")
                target = staging.joinpath(*relative.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                self.filesystem().get_file(key, str(target))
            if dest_path.exists():
                shutil.rmtree(dest_path)
            staging.rename(dest_path)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return dest_path

    async def download(self, lora_uri: str, dest_path: Path) -> Path:
        return await asyncio.to_thread(self._download, lora_uri, dest_path)
