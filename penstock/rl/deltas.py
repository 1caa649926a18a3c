"""Weight deltas a trainer publishes to a folder, applied to a host-local checkpoint.

slime and SkyRL can publish a training step's weights as changes against the previous
step instead of a whole checkpoint. Each engine patches a copy of the checkpoint on its
own disk, then reloads that copy (``update_weights_from_disk``):

slime (``POST /pull_weights {local_checkpoint_dir, source_dir, target_version}``)
    ``<source_dir>/weight_v<N:06d>/`` holds version N: an ordinary checkpoint (a full
    version, copied as it is) or, when the metadata of its ``model.safetensors.index.json``
    names a ``delta_encoding``, safetensors files of zstd-compressed patches against
    version N-1, one uint8 tensor per changed tensor: ``xor``, or ``overwrite`` (a
    little-endian u32 count, that many u32 byte positions, then the new bytes there). Each
    file's ``__metadata__`` maps a tensor to the checksum of its new bytes
    (``checksum_format``). The checkpoint is ``local_checkpoint_dir`` itself; version 0
    is the served model's folder.
SkyRL (``POST /fetch_weights {target_version, sync_dir?, uri?}``)
    ``<sync_dir>/delta-<N:08d>/manifest.json`` (or ``uri`` for the target version) lists
    version N's changed tensors, each an XOR patch against version N-1, zstd-compressed,
    stored as a uint8 tensor (``payload_key`` in ``payload_file``) with the checksum of
    its new bytes. The checkpoint is ``<local_checkpoint_dir>/weights``; version 0 is
    ``base_model_path``.

Checksums: ``xxh3-128`` (the ``xxhash`` module),
``sha256``, ``adler32`` and ``blake3`` (with the ``blake3`` module). Folders are local
paths only: a remote URI is a 400 naming the field.

A state file beside the checkpoint records the version it holds. While a version is being
applied the file says so; an apply that fails (a checksum that does not match, a missing
payload, a patch of the wrong size) leaves the copy marked unfinished, and the next pull
copies its base again and replays every version. The served weights never change here:
only the reload changes them, and it loads the whole checkpoint before swapping it in.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import mmap
import shutil
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from penstock.errors import InvalidRequestError

if TYPE_CHECKING:
    import numpy as np

STATE_DIR = ".penstock-weight-sync"
SLIME_INDEX = "model.safetensors.index.json"
SKYRL_MANIFEST = "manifest.json"
REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "http://", "https://", "hf://")


class DeltaRefused(InvalidRequestError):
    """Published weights that cannot be applied: a 400 naming the request field that led
    to them; the local checkpoint is left marked unfinished."""

    default_code = "invalid_weights"


@dataclass(frozen=True)
class TensorPatch:
    """One changed tensor of a version: compressed patch bytes and the checksum of the
    tensor's new bytes."""

    name: str
    compressed: bytes
    checksum: str
    algorithm: str
    encoding: str = "xor"


@dataclass(frozen=True)
class PullReport:
    version: int
    seeded_from: str | None
    applied: list[int]
    patched_tensors: int
    skipped: list[str]

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "seeded_from": self.seeded_from,
            "applied_versions": self.applied,
            "patched_tensors": self.patched_tensors,
            "skipped_tensors": self.skipped,
        }


def _xxh3_128(data: np.ndarray) -> str:
    return str(xxhash.xxh3_128_hexdigest(data.data))


def _blake3(data: np.ndarray) -> str:
    blake3 = importlib.import_module("blake3")
    return str(blake3.blake3(data.data).hexdigest())


_CHECKSUMS = {
    "xxh3-128": _xxh3_128,
    "sha256": lambda data: hashlib.sha256(data.data).hexdigest(),
    "adler32": lambda data: f"{zlib.adler32(data.data) & 0xFFFFFFFF:08x}",
    "blake3": _blake3,
}


def checksum(algorithm: str, data: np.ndarray) -> str:
    """The hex digest of ``data`` (uint8, contiguous) as the publishers write it."""
    compute = _CHECKSUMS.get(algorithm)
    if compute is None:
        raise DeltaRefused(
            f"checksum algorithm {algorithm!r} is not supported; supported: {', '.join(_CHECKSUMS)}"
        )
    import numpy as np

    try:
        return compute(np.ascontiguousarray(data))
    except ImportError as exc:
        raise DeltaRefused(
            f"checksum algorithm {algorithm!r} needs the {exc.name or algorithm} module, "
            "which this server does not have"
        ) from exc


def local_folder(value: str, field: str) -> Path:
    """``value`` as a local folder path: remote URIs are refused, never fetched."""
    if value.startswith(REMOTE_SCHEMES) or "://" in value:
        raise InvalidRequestError(
            f"'{field}' must be a local folder: remote storage ({value.split('://')[0]}://) "
            "is not read by this server",
            param=field,
            code="invalid_value",
        )
    return Path(value.removeprefix("file://"))


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """The data offset and the JSON header of a safetensors file."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return 8 + length, json.loads(handle.read(length))


def _read_tensor_bytes(path: Path, key: str) -> bytes:
    start, header = safetensors_header(path)
    info = header.get(key)
    if info is None:
        raise DeltaRefused(f"{path.name} holds no tensor {key!r}")
    begin, end = info["data_offsets"]
    with path.open("rb") as handle:
        handle.seek(start + begin)
        return handle.read(end - begin)


def _patched(region: np.ndarray, patch: TensorPatch) -> None:
    """Apply ``patch`` to ``region`` (the tensor's bytes in the checkpoint, writable)."""
    # Imported with the first delta: most servers never apply one.
    import numpy as np
    import zstandard

    size = region.nbytes
    raw = zstandard.ZstdDecompressor().decompress(patch.compressed, max_output_size=size * 5 + 4)
    data = np.frombuffer(raw, dtype=np.uint8)
    if patch.encoding == "xor":
        if data.size != size:
            raise DeltaRefused(
                f"the patch of {patch.name!r} has {data.size} bytes; the tensor has {size}"
            )
        region ^= data
        return
    if patch.encoding != "overwrite":
        raise DeltaRefused(f"delta encoding {patch.encoding!r} is not supported: xor, overwrite")
    (count,) = struct.unpack("<I", raw[:4])
    positions = data[4 : 4 + 4 * count].view("<u4")
    values = data[4 + 4 * count :]
    if positions.size != count or values.size != count or (count and positions.max() >= size):
        raise DeltaRefused(f"the overwrite patch of {patch.name!r} does not fit the tensor")
    region[positions] = values


class LocalCheckpoint:
    """A checkpoint folder on this host and the version it holds."""

    def __init__(self, weights: Path) -> None:
        self.weights = weights
        self.state_dir = weights / STATE_DIR

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Held across a whole pull: engines of one host share the folder."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with (self.state_dir / "lock").open("w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def version(self) -> int | None:
        """The version held, or None: nothing copied yet, or an apply that never finished."""
        try:
            state = json.loads((self.state_dir / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        if not state.get("complete"):
            return None
        return int(state["version"])

    def _record(self, version: int, *, complete: bool) -> None:
        path = self.state_dir / "state.json"
        staged = path.with_suffix(".tmp")
        staged.write_text(json.dumps({"version": version, "complete": complete}))
        staged.replace(path)

    def seed(self, source: Path, version: int) -> None:
        """Make the folder a copy of the checkpoint files in ``source`` (others removed)."""
        if not source.is_dir():
            raise DeltaRefused(f"no checkpoint folder at {source}")
        self._record(version, complete=False)
        files = [entry for entry in source.iterdir() if entry.is_file()]
        names = {entry.name for entry in files}
        for entry in self.weights.iterdir():
            if entry.is_file() and entry.name not in names:
                entry.unlink()
        for entry in files:
            staged = self.weights / f".{entry.name}.partial"
            shutil.copyfile(entry, staged)
            staged.replace(self.weights / entry.name)
        self._record(version, complete=True)

    def apply(self, version: int, patches: list[TensorPatch], *, skip_absent: bool) -> list[str]:
        """Patch the tensors in place; returns the names absent from the checkpoint that
        ``skip_absent`` let pass (else they are a refusal)."""
        locations = self._locations()
        absent = [patch.name for patch in patches if patch.name not in locations]
        if absent and not skip_absent:
            raise DeltaRefused(
                f"version {version} patches tensors not in the checkpoint: {absent[:5]}"
            )
        # Imported with the first delta, as zstandard: most servers never apply one.
        import numpy as np

        self._record(version, complete=False)
        mismatched: list[str] = []
        maps: dict[Path, tuple[Any, mmap.mmap]] = {}
        try:
            for patch in patches:
                if patch.name not in locations:
                    continue
                path, offset, size = locations[patch.name]
                if path not in maps:
                    handle = path.open("r+b")
                    maps[path] = (handle, mmap.mmap(handle.fileno(), 0))
                region = np.ndarray((size,), dtype=np.uint8, buffer=maps[path][1], offset=offset)
                _patched(region, patch)
                if checksum(patch.algorithm, region) != patch.checksum:
                    mismatched.append(patch.name)
                del region
        finally:
            for handle, mapped in maps.values():
                mapped.close()
                handle.close()
        if mismatched:
            raise DeltaRefused(
                f"version {version}: the patched bytes of {len(mismatched)} tensor(s) do not "
                f"match their published checksums: {sorted(mismatched)[:5]}"
            )
        self._record(version, complete=True)
        return absent

    def _locations(self) -> dict[str, tuple[Path, int, int]]:
        found: dict[str, tuple[Path, int, int]] = {}
        for path in sorted(self.weights.glob("*.safetensors")):
            start, header = safetensors_header(path)
            for name, info in header.items():
                if name != "__metadata__":
                    begin, end = info["data_offsets"]
                    found[name] = (path, start + begin, end - begin)
        if not found:
            raise DeltaRefused(f"no safetensors weights in {self.weights}")
        return found


def _slime_version_dir(source: Path, version: int) -> Path:
    return source / f"weight_v{version:06d}"


def _slime_metadata(folder: Path) -> dict[str, Any] | None:
    """A version folder's delta metadata, or None for a full checkpoint."""
    if not folder.is_dir():
        raise DeltaRefused(f"published weight version missing: {folder}")
    index = folder / SLIME_INDEX
    if not index.is_file():
        return None
    metadata = json.loads(index.read_text()).get("metadata") or {}
    return metadata if "delta_encoding" in metadata else None


def _slime_patches(folder: Path, metadata: dict[str, Any]) -> list[TensorPatch]:
    if metadata.get("compression_format", "zstd") != "zstd":
        raise DeltaRefused(f"compression {metadata['compression_format']!r} is not supported")
    algorithm = str(metadata.get("checksum_format", "xxh3-128"))
    patches = []
    for path in sorted(folder.glob("*.safetensors")):
        _, header = safetensors_header(path)
        sums = header.get("__metadata__") or {}
        for name in header:
            if name == "__metadata__":
                continue
            if name not in sums:
                raise DeltaRefused(f"{path.name} gives no checksum for {name!r}")
            patches.append(
                TensorPatch(
                    name,
                    _read_tensor_bytes(path, name),
                    sums[name],
                    algorithm,
                    str(metadata["delta_encoding"]),
                )
            )
    return patches


def pull_slime(local: Path, base: Path, source: Path, target: int) -> PullReport:
    """slime's ``/pull_weights``: bring ``local`` to version ``target`` of ``source``."""
    if not base.is_dir():
        # Version 0 is the served checkpoint: without its folder there is nothing to patch.
        raise DeltaRefused(
            f"the served model {base} is not a local checkpoint folder, which delta pulls "
            "start from",
            code="unsupported_operation",
        )
    if target > 0 and not source.is_dir():
        raise DeltaRefused(f"'source_dir' is not a folder: {source}", param="source_dir")
    checkpoint = LocalCheckpoint(local)
    with checkpoint.locked():
        held = checkpoint.version()
        # A copy ahead of the target (a restarted run) starts again below it.
        floor = held if held is not None and held <= target else 0
        start = target
        while start > floor and _slime_metadata(_slime_version_dir(source, start)) is not None:
            start -= 1
        seeded = None
        if held is None or held > target or start > held:
            seed = base if start == 0 else _slime_version_dir(source, start)
            checkpoint.seed(seed, start)
            seeded = str(seed)
        else:
            start = held
        applied, patched = [], 0
        for version in range(start + 1, target + 1):
            folder = _slime_version_dir(source, version)
            metadata = _slime_metadata(folder)
            if metadata is None:
                raise DeltaRefused(f"{folder} is a full checkpoint below the target")
            if int(metadata.get("base_version", -1)) != version - 1:
                raise DeltaRefused(
                    f"{folder} builds on version {metadata.get('base_version')}, not {version - 1}"
                )
            patches = _slime_patches(folder, metadata)
            checkpoint.apply(version, patches, skip_absent=False)
            applied.append(version)
            patched += len(patches)
        return PullReport(target, seeded, applied, patched, [])


def _skyrl_patches(folder: Path, manifest: dict[str, Any]) -> list[TensorPatch]:
    patches = []
    for record in manifest.get("tensors", []):
        # Older manifests name the checksum ``sha256``.
        digest = record.get("checksum", record.get("sha256"))
        default = "xxh3-128" if "checksum" in record else "sha256"
        algorithm = record.get("checksum_algorithm", default)
        payload = folder / record["payload_file"]
        if not payload.is_file():
            raise DeltaRefused(f"payload file missing: {payload}")
        compressed = _read_tensor_bytes(payload, record["payload_key"])
        patches.append(TensorPatch(record["name"], compressed, digest, algorithm))
    return patches


def fetch_skyrl(
    local_root: Path, base: Path, sync_dir: Path | None, uri: Path | None, target: int
) -> PullReport:
    """SkyRL's ``/fetch_weights``: bring ``<local_root>/weights`` to version ``target``."""
    weights = local_root / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    checkpoint = LocalCheckpoint(weights)
    with checkpoint.locked():
        held = checkpoint.version()
        seeded = None
        if held is None:
            checkpoint.seed(base, 0)
            held, seeded = 0, str(base)
        if held > target:
            raise DeltaRefused(
                f"the local checkpoint holds version {held}, past target_version {target}",
                param="target_version",
            )
        applied, patched, skipped = [], 0, []
        for version in range(held + 1, target + 1):
            if version == target and uri is not None:
                folder = uri
            elif sync_dir is not None:
                folder = sync_dir / f"delta-{version:08d}"
            else:
                raise DeltaRefused("sync_dir is needed to reach the target", param="sync_dir")
            try:
                manifest = json.loads((folder / SKYRL_MANIFEST).read_text())
            except FileNotFoundError as exc:
                raise DeltaRefused(f"no {SKYRL_MANIFEST} in {folder}") from exc
            if int(manifest["version"]) != version or int(manifest["base_version"]) != version - 1:
                raise DeltaRefused(
                    f"{folder} is version {manifest['version']} on {manifest['base_version']}; "
                    f"expected {version} on {version - 1}"
                )
            patches = _skyrl_patches(folder, manifest)
            # SkyRL leaves out tensors the checkpoint does not store (tied weights).
            skipped += checkpoint.apply(version, patches, skip_absent=True)
            applied.append(version)
            patched += len(patches)
        return PullReport(target, seeded, applied, patched, skipped)


def held_version(weights: Path) -> int | None:
    return LocalCheckpoint(weights).version()
