"""Upload per-choice request metadata (e.g. RL rollout data) to an fsspec location.

A request opts in with ``nvext.metadata_upload = {"url": "<fsspec url>"}`` (also accepted
under ``extra_args.nvext``). After it finishes, each choice's metadata is written as
``choice_<i>.msgpack.zst``: zstd-compressed msgpack of ``{"schema_version": 1,
"metadata": ...}``, where tensors and arrays become ``{"type", "dtype", "shape", "data"}``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import msgpack
import zstandard
from fsspec.implementations.dirfs import DirFileSystem

SCHEMA_VERSION = 1


def get_fs(url: str) -> DirFileSystem:
    """A filesystem rooted at ``url``; a plain path means the local disk."""
    protocol, sep, _ = url.partition("://")
    if not sep:
        protocol = "file"
    options = {"auto_mkdir": True} if protocol in ("file", "local") else {}
    fs, root = fsspec.core.url_to_fs(url, **options)
    return DirFileSystem(path=root, fs=fs)


def _tensor(value: Any) -> dict[str, Any]:
    tensor = value.detach().cpu().contiguous()
    try:
        data = tensor.numpy().tobytes()
    except (TypeError, RuntimeError):
        # dtypes numpy lacks (bfloat16, float8) still have a byte view.
        import torch

        data = tensor.view(torch.uint8).numpy().tobytes()
    return {
        "type": "tensor",
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "data": data,
    }


def normalize(value: Any) -> Any:
    """Turn tensors and arrays into msgpack-able dicts; recurse through containers."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _tensor(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        array = numpy.ascontiguousarray(value)
        return {
            "type": "ndarray",
            "dtype": str(array.dtype),
            "shape": list(array.shape),
            "data": array.tobytes(),
        }
    if numpy is not None and isinstance(value, numpy.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {key: normalize(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [normalize(item) for item in value]
    return value


def encode_metadata(metadata: Mapping[str, Any]) -> bytes:
    packed = msgpack.packb(
        {"schema_version": SCHEMA_VERSION, "metadata": normalize(metadata)}, use_bin_type=True
    )
    return zstandard.ZstdCompressor().compress(packed)


def decode_metadata(blob: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode_metadata` (tensors stay in their dict form)."""
    return msgpack.unpackb(zstandard.ZstdDecompressor().decompress(blob), raw=False)


@dataclass(frozen=True)
class MetadataUploader:
    url: str

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ValueError("metadata_upload.url must be a string")
        url = self.url.strip()
        if not url:
            raise ValueError("metadata_upload.url must not be empty")
        object.__setattr__(self, "url", url)

    @classmethod
    def from_settings(cls, settings: dict[str, Any] | None) -> MetadataUploader | None:
        if settings is None:
            return None
        if not isinstance(settings, Mapping):
            raise ValueError("metadata_upload must be an object")
        unexpected = sorted(set(settings) - {"url"})
        if unexpected:
            raise ValueError(f"metadata_upload.{unexpected[0]} is not supported")
        if "url" not in settings:
            raise ValueError("metadata_upload.url is required")
        return cls(settings["url"])

    @classmethod
    def from_backend_request(cls, request: dict[str, Any]) -> MetadataUploader | None:
        """The uploader a request asks for in ``nvext`` (or ``extra_args.nvext``), if any."""
        extra_args = request.get("extra_args")
        sources = (
            request.get("nvext"),
            extra_args.get("nvext") if isinstance(extra_args, Mapping) else None,
        )
        for source in sources:
            if not isinstance(source, Mapping) or source.get("metadata_upload") is None:
                continue
            settings = source["metadata_upload"]
            if not isinstance(settings, Mapping):
                raise ValueError("metadata_upload must be an object")
            return cls.from_settings(dict(settings))
        return None

    def file_name(self, choice_index: int) -> str:
        return f"choice_{choice_index}.msgpack.zst"

    async def upload_choice(self, choice_index: int, metadata: dict[str, Any]) -> None:
        """Write ``metadata`` for one choice; nothing is written for empty metadata."""
        if not metadata:
            return
        await asyncio.to_thread(self._upload, choice_index, metadata)

    def _upload(self, choice_index: int, metadata: dict[str, Any]) -> None:
        get_fs(self.url).pipe_file(self.file_name(choice_index), encode_metadata(metadata))
