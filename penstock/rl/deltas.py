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

The checkpoint folder is this server's: one it created, or found empty (it marks it with
its state folder); a folder holding anything else is a 400, and a new seed removes only
files an earlier seed wrote there. It is never the served model's folder (nor inside or
above it), a system folder, the root or a home folder, and with ``--weights-dir`` it lies
inside that folder (:func:`checkpoint_folder`).

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


# Folders of the system a checkpoint is never written in; the scratch ones within them are
# allowed.
_SYSTEM_FOLDERS = tuple(
    Path(name)
    for name in (
        "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
        "/run", "/sbin", "/sys", "/usr", "/var",
    )
)  # fmt: skip
_SCRATCH_FOLDERS = (Path("/var/tmp"),)


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def checkpoint_folder(
    value: str, field: str, *, apart_from: list[Path], allowed: Path | None
) -> Path:
    """``value`` as a folder this server may keep a local checkpoint in (resolved): a 400
    naming ``field`` when it is at, inside or above a folder of ``apart_from`` (the served
    model's own), outside ``allowed`` (the operator's ``--weights-dir``) when one is set,
    else in a system folder, or the root or a home folder itself."""
    folder = local_folder(value, field).expanduser().resolve()

    def refuse(reason: str) -> InvalidRequestError:
        return InvalidRequestError(f"'{field}' {reason}", param=field, code="invalid_value")

    for kept in apart_from:
        kept = kept.expanduser().resolve()
        if _within(folder, kept) or _within(kept, folder):
            raise refuse(f"must lie apart from the served model's checkpoint {kept}: {folder}")
    if allowed is not None:
        if not _within(folder, allowed.expanduser().resolve()):
            raise refuse(f"must lie inside the server's --weights-dir {allowed}: {folder}")
        return folder
    system = any(_within(folder, root) for root in _SYSTEM_FOLDERS) and not any(
        _within(folder, scratch) for scratch in _SCRATCH_FOLDERS
    )
    if system or folder == Path(folder.anchor) or folder == Path.home().resolve():
        raise refuse(f"names a system folder, which this server never writes in: {folder}")
    return folder


# What reading a malformed publication raises (a field missing or of the wrong type, bytes
# that are not what they claim to be); :func:`_published` makes each a refusal.
_MALFORMED = (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError)
# safetensors' own bound on a header: a longer one is not a safetensors file.
_MAX_HEADER_BYTES = 100_000_000


@contextmanager
def _published(what: object) -> Iterator[None]:
    """Refuse (400 ``invalid_weights``) the weights ``what`` names when reading them fails
    on their contents, rather than fail the request with a 500."""
    try:
        yield
    except DeltaRefused:
        raise
    except (*_MALFORMED, struct.error) as exc:
        raise DeltaRefused(f"{what} is malformed: {type(exc).__name__}: {exc}") from exc


def _read_file(path: Path, size: int = -1, offset: int = 0) -> bytes:
    """``size`` bytes of ``path`` from ``offset`` (all when -1); an unreadable file, or
    one shorter than that, is a refusal."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read(size)
    except OSError as exc:
        raise DeltaRefused(f"cannot read {path}: {exc.strerror or exc}") from exc
    if size >= 0 and len(data) != size:
        raise DeltaRefused(f"{path} ends before the {size} bytes it should hold at {offset}")
    return data


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """The data offset and the JSON header of a safetensors file."""
    with _published(path):
        (length,) = struct.unpack("<Q", _read_file(path, 8))
        if length > _MAX_HEADER_BYTES:
            raise DeltaRefused(f"{path} declares a header of {length} bytes")
        header = json.loads(_read_file(path, length, 8))
        if not isinstance(header, dict):
            raise DeltaRefused(f"{path} has no safetensors header")
        return 8 + length, header


def _read_tensor_bytes(path: Path, key: str) -> bytes:
    start, header = safetensors_header(path)
    info = header.get(key)
    if info is None:
        raise DeltaRefused(f"{path.name} holds no tensor {key!r}")
    with _published(path):
        begin, end = (int(offset) for offset in info["data_offsets"])
        if not 0 <= begin <= end:
            raise DeltaRefused(f"{path.name}: the offsets of {key!r} are out of order")
        return _read_file(path, end - begin, start + begin)


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a missing, unreadable or malformed one is a refusal."""
    if not path.is_file():
        raise DeltaRefused(f"no {path.name} in {path.parent}")
    with _published(path):
        value = json.loads(_read_file(path))
    if not isinstance(value, dict):
        raise DeltaRefused(f"{path} holds no JSON object")
    return value


def _patched(region: np.ndarray, patch: TensorPatch) -> None:
    """Apply ``patch`` to ``region`` (the tensor's bytes in the checkpoint, writable)."""
    # Imported with the first delta: most servers never apply one.
    import numpy as np
    import zstandard

    size = region.nbytes
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            patch.compressed, max_output_size=size * 5 + 4
        )
    except zstandard.ZstdError as exc:
        raise DeltaRefused(f"the patch of {patch.name!r} is not zstd data: {exc}") from exc
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

    def __init__(self, weights: Path, field: str | None = None) -> None:
        self.weights = weights
        self.state_dir = weights / STATE_DIR
        self._field = field

    def _claim(self) -> None:
        """Make the folder this server's: created when missing; one found must be empty
        or already hold this server's state."""
        if self.weights.exists() and not self.weights.is_dir():
            raise DeltaRefused(f"{self.weights} is not a folder", param=self._field)
        if (
            self.weights.is_dir()
            and not self.state_dir.is_dir()
            and any(True for _ in self.weights.iterdir())
        ):
            raise DeltaRefused(
                f"{self.weights} holds files this server did not write: name a new or empty "
                "folder for the local checkpoint",
                param=self._field,
                code="invalid_value",
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Held across a whole pull: engines of one host share the folder."""
        self._claim()
        with (self.state_dir / "lock").open("w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _state(self) -> dict[str, Any]:
        try:
            state = json.loads((self.state_dir / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def version(self) -> int | None:
        """The version held, or None: nothing copied yet, or an apply that never finished."""
        state = self._state()
        if not state.get("complete"):
            return None
        return int(state["version"])

    def _written(self) -> set[str]:
        """The names of the files a seed wrote into the folder."""
        return {str(name) for name in self._state().get("files", [])}

    def _record(self, version: int, *, complete: bool, files: set[str] | None = None) -> None:
        path = self.state_dir / "state.json"
        written = self._written() if files is None else files
        state = {"version": version, "complete": complete, "files": sorted(written)}
        staged = path.with_suffix(".tmp")
        staged.write_text(json.dumps(state))
        staged.replace(path)

    def seed(self, source: Path, version: int) -> None:
        """Make the folder a copy of the checkpoint files in ``source``: the files an
        earlier seed wrote that ``source`` lacks are removed, nothing else."""
        if not source.is_dir():
            raise DeltaRefused(f"no checkpoint folder at {source}")
        files = [entry for entry in source.iterdir() if entry.is_file()]
        names = {entry.name for entry in files}
        written = self._written()
        self._record(version, complete=False, files=written | names)
        for name in written - names:
            (self.weights / name).unlink(missing_ok=True)
        for entry in files:
            staged = self.weights / f".{entry.name}.partial"
            shutil.copyfile(entry, staged)
            staged.replace(self.weights / entry.name)
        self._record(version, complete=True, files=names)

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
    metadata = _json_object(index).get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DeltaRefused(f"the metadata of {index} is not an object")
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
    checkpoint = LocalCheckpoint(local, "local_checkpoint_dir")
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
            with _published(folder):
                metadata = _slime_metadata(folder)
                if metadata is None:
                    raise DeltaRefused(f"{folder} is a full checkpoint below the target")
                if int(metadata.get("base_version", -1)) != version - 1:
                    raise DeltaRefused(
                        f"{folder} builds on version {metadata.get('base_version')}, "
                        f"not {version - 1}"
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
        payload = (folder / str(record["payload_file"])).resolve()
        if folder.resolve() not in payload.parents:
            raise DeltaRefused(f"payload file {record['payload_file']!r} is outside {folder}")
        if not payload.is_file():
            raise DeltaRefused(f"payload file missing: {payload}")
        compressed = _read_tensor_bytes(payload, record["payload_key"])
        patches.append(TensorPatch(record["name"], compressed, digest, algorithm))
    return patches


def fetch_skyrl(
    local_root: Path, base: Path, sync_dir: Path | None, uri: Path | None, target: int
) -> PullReport:
    """SkyRL's ``/fetch_weights``: bring ``<local_root>/weights`` to version ``target``."""
    checkpoint = LocalCheckpoint(local_root / "weights")
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
            with _published(folder):
                manifest = _json_object(folder / SKYRL_MANIFEST)
                if (int(manifest["version"]), int(manifest["base_version"])) != (
                    version,
                    version - 1,
                ):
                    raise DeltaRefused(
                        f"{folder} is version {manifest['version']} on "
                        f"{manifest['base_version']}; expected {version} on {version - 1}"
                    )
                patches = _skyrl_patches(folder, manifest)
                # SkyRL leaves out tensors the checkpoint does not store (tied weights).
                skipped += checkpoint.apply(version, patches, skip_absent=True)
            applied.append(version)
            patched += len(patches)
        return PullReport(target, seeded, applied, patched, skipped)


def held_version(weights: Path) -> int | None:
    return LocalCheckpoint(weights).version()
