"""Upload per-choice request metadata (e.g. RL rollout data) to an fsspec location.

:class:`MetadataUploader` keeps Dynamo's contract: built from ``nvext.metadata_upload =
{"url": "<fsspec url>"}`` (also accepted under ``extra_args.nvext``), it writes each
choice's metadata as ``choice_<i>.msgpack.zst``: zstd-compressed msgpack of
``{"schema_version": 1, "metadata": ...}``, where tensors and arrays become ``{"type",
"dtype", "shape", "data"}``.

The gateway never lets a client pick the destination: it reads the request's ``url`` as a
key relative to the operator's root (``--metadata-upload-url``) and builds the uploader
with :func:`under_root`, whose :func:`upload_key` check keeps every accepted key strictly
inside that root.

zstandard is imported with the first upload: most servers never upload. MessagePack is
msgspec's codec, the one the engines' forward-pass metrics use too.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from penstock.destinations import local_path

if TYPE_CHECKING:
    from fsspec.implementations.dirfs import DirFileSystem

SCHEMA_VERSION = 1

MAX_KEY_LENGTH = 256
# Letters, digits, '_', '-' and '.', never leading with '.' or '-': no '.'/'..' parts, no
# hidden names, nothing a shell or URL would read specially.
_KEY_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def get_fs(url: str) -> DirFileSystem:
    """A filesystem rooted at ``url``; a plain path or a ``file://`` URL means the local disk."""
    # Imported here: only servers given an upload root pay fsspec's ~15 MB.
    import fsspec
    from fsspec.implementations.dirfs import DirFileSystem

    protocol, sep, _ = url.partition("://")
    if not sep or protocol == "file":
        fs, root = fsspec.core.url_to_fs(local_path(url), auto_mkdir=True)
    else:
        fs, root = fsspec.core.url_to_fs(url)
    return DirFileSystem(path=root, fs=fs)


def upload_key(key: str) -> str:
    """``key`` if it is a safe relative key; otherwise ValueError saying why.

    Parts are separated by '/', and each is letters, digits, '_', '-' or '.', starting
    with a letter, a digit or '_'; at most :data:`MAX_KEY_LENGTH` characters in all.
    """
    field = "metadata_upload.url"
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"{field} must be at most {MAX_KEY_LENGTH} characters; got {len(key)}")
    if ":" in key:
        raise ValueError(f"{field} must be a key relative to the server's upload root, not a URL")
    if key.startswith("/"):
        raise ValueError(f"{field} must be a relative key, not an absolute path")
    parts = key.split("/")
    if any(part in (".", "..") for part in parts):
        raise ValueError(f"{field} must not contain '.' or '..' parts")
    if not all(_KEY_PART.fullmatch(part) for part in parts):
        raise ValueError(
            f"{field} must be '/'-separated parts of letters, digits, '_', '-' and '.', "
            "each starting with a letter, a digit or '_'"
        )
    return key


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
    import zstandard

    packed = msgspec.msgpack.encode(
        {"schema_version": SCHEMA_VERSION, "metadata": normalize(metadata)}
    )
    return zstandard.ZstdCompressor().compress(packed)


def decode_metadata(blob: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode_metadata` (tensors stay in their dict form)."""
    import zstandard

    decoded: dict[str, Any] = msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(blob))
    return decoded


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


def under_root(root: str, key: str) -> MetadataUploader:
    """The uploader for ``key`` (checked by :func:`upload_key`) inside the operator's root."""
    return MetadataUploader(f"{root.rstrip('/')}/{upload_key(key)}")
