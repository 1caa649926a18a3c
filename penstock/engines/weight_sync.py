"""Weight sync shared by the engines and the trainer helper (:mod:`penstock.rl.trainer`).

**Checksum** (what every successful update returns and ``weights_checker`` computes): per
tensor, SHA-256 of its raw bytes (C-contiguous, on the CPU, in the engine's dtype, native
little-endian); for a set of tensors, SHA-256 of the UTF-8 lines
``"{name}\\t{dtype}\\t{shape}\\t{tensor digest}\\n"`` in sorted name order, where ``dtype``
is the short torch name (``float32``, ``bfloat16``) and ``shape`` is comma-separated
(``"64,128"``; ``""`` for a scalar).

**Collective group** (``init_weights_update_group``): the trainer is rank 0 and hosts a
TCP rendezvous store at ``master_address:master_port``; the engine joins as rank
``rank_offset`` of ``world_size``. The group lives under ``group_name`` beside any default
group (none is needed), as SGLang's and vLLM's custom groups do, so a trainer that
already speaks to them joins the same way. ``gloo`` works on the CPU, ``nccl`` needs CUDA.

**Broadcast protocol** (``update_weights_from_distributed``): after the HTTP call, rank 0
broadcasts each listed tensor in order, as declared (``names``/``dtypes``/``shapes``);
with ``load_format: "flattened_bucket"`` all listed tensors share one dtype and travel as
one 1-D tensor, concatenated in ``names`` order.

**Tensor payloads** (``update_weights_from_tensor``): each entry of
``serialized_named_tensors`` is base64 text of a safetensors file (the default and the
only form accepted unless the operator trusts payloads). A pickled payload (what
``MultiprocessingSerializer`` produces: a list of ``(name, tensor)`` pairs, or a dict;
on the same host its tensors may live in shared memory) is unpickled only with
``--trust-weight-payloads``, since unpickling runs code the sender chose.

Torch is imported inside the functions that need it: the gateway imports this module.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_GROUP_NAME = "weight_update_group"
TRUST_FLAG = "--trust-weight-payloads"
# Pickle protocols 2..5 open with PROTO (0x80) and the protocol number.
_PICKLE_PREFIXES = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}


class WeightSyncError(ValueError):
    """A weight update request that cannot be applied; the old weights keep serving."""


class UntrustedPayloadError(WeightSyncError):
    """A pickled payload on a server that does not trust payloads."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    import torch

    short = _DTYPE_ALIASES.get(name, name.removeprefix("torch."))
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r}")
    return dtype


def tensor_digest(tensor: torch.Tensor) -> str:
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def combine_digests(entries: Iterable[tuple[str, str, tuple[int, ...], str]]) -> str:
    """The set checksum from ``(name, dtype, shape, digest)`` entries, in any order."""
    total = hashlib.sha256()
    for name, dtype, shape, digest in sorted(entries):
        line = f"{name}\t{dtype}\t{','.join(map(str, shape))}\t{digest}\n"
        total.update(line.encode())
    return total.hexdigest()


def weights_checksum(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> tuple[str, dict[str, str]]:
    """``(checksum, {name: digest})``; ``dtype`` casts first (the engine's dtype)."""
    digests: dict[str, str] = {}
    entries = []
    for name, tensor in tensors.items():
        cast = tensor if dtype is None else tensor.detach().to(dtype)
        digest = tensor_digest(cast)
        digests[name] = digest
        entries.append((name, dtype_name(cast.dtype), tuple(cast.shape), digest))
    return combine_digests(entries), digests


def parse_specs(body: Mapping[str, Any]) -> list[TensorSpec]:
    """``names``/``dtypes``/``shapes``, or SkyRL's singular ``name``/``dtype``/``shape``."""
    if "names" not in body and "name" in body:
        names, dtypes, shapes = [body.get("name")], [body.get("dtype")], [body.get("shape")]
        fields = ("name", "dtype", "shape")
    else:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        fields = ("names", "dtypes", "shapes")
    for field, value in zip(fields, (names, dtypes, shapes), strict=True):
        if not isinstance(value, list) or not value:
            raise WeightSyncError(f"'{field}' is required: a non-empty list")
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightSyncError(
            f"'names', 'dtypes' and 'shapes' must have the same length; got "
            f"{len(names)}, {len(dtypes)} and {len(shapes)}"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not name:
            raise WeightSyncError(f"'{fields[0]}' holds {name!r}, not a tensor name")
        if not isinstance(dtype, str):
            raise WeightSyncError(f"'{fields[1]}' of {name} must be a string; got {dtype!r}")
        parse_dtype(dtype)
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WeightSyncError(f"'{fields[2]}' of {name} must be a list of sizes")
        specs.append(TensorSpec(name, dtype, tuple(shape)))
    if len({spec.name for spec in specs}) != len(specs):
        raise WeightSyncError(f"'{fields[0]}' names a tensor twice")
    return specs


def check_against(specs: Iterable[TensorSpec], live: Mapping[str, torch.Tensor]) -> None:
    """Every name known, every shape equal, every dtype castable; else one message for all."""
    problems = []
    for spec in specs:
        target = live.get(spec.name)
        if target is None:
            problems.append(f"{spec.name}: not a tensor of this model")
            continue
        if tuple(target.shape) != spec.shape:
            problems.append(
                f"{spec.name}: shape {list(spec.shape)} != the model's {list(target.shape)}"
            )
        sent = parse_dtype(spec.dtype)
        if sent.is_floating_point != target.dtype.is_floating_point or (
            not target.dtype.is_floating_point and sent != target.dtype
        ):
            problems.append(
                f"{spec.name}: dtype {dtype_name(sent)} cannot load into the model's "
                f"{dtype_name(target.dtype)}"
            )
    if problems:
        shown = "; ".join(problems[:5])
        more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise WeightSyncError(shown + more)


def init_custom_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
) -> Any:
    """Join (rank > 0) or host (rank 0) a process group without a default group."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(
            f"tcp://{master_address}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    )
    store.set_timeout(timeout)
    made = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    group = made[0] if isinstance(made, tuple) else made
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_process_group(group: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def broadcast_specs(
    group: Any,
    specs: list[TensorSpec],
    *,
    device: torch.device,
    flattened: bool,
    sink: Any,
) -> None:
    """Receive ``specs`` from rank 0; ``sink(spec, tensor)`` takes each one as it lands."""
    import torch
    import torch.distributed as dist

    if flattened:
        dtypes = {spec.dtype for spec in specs}
        if len(dtypes) != 1:
            raise WeightSyncError("a flattened_bucket holds tensors of one dtype only")
        sizes = [_numel(spec.shape) for spec in specs]
        flat = torch.empty(sum(sizes), dtype=parse_dtype(specs[0].dtype), device=device)
        dist.broadcast(flat, src=0, group=group)
        offset = 0
        for spec, size in zip(specs, sizes, strict=True):
            sink(spec, flat[offset : offset + size].view(spec.shape))
            offset += size
        return
    for spec in specs:
        buffer = torch.empty(spec.shape, dtype=parse_dtype(spec.dtype), device=device)
        dist.broadcast(buffer, src=0, group=group)
        sink(spec, buffer)


def _numel(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def is_pickled(raw: bytes) -> bool:
    return raw[:2] in _PICKLE_PREFIXES


def decode_payload(text: Any, *, trusted: bool) -> dict[str, torch.Tensor]:
    """One ``serialized_named_tensors`` entry as ``{name: tensor}``."""
    if not isinstance(text, str | bytes) or not text:
        raise WeightSyncError("each entry must be base64 text")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WeightSyncError(f"an entry is not valid base64: {exc}") from exc
    if is_pickled(raw):
        if not trusted:
            raise UntrustedPayloadError(
                "the payload is pickled, and unpickling runs code the sender chose; send "
                f"safetensors bytes, or start the server with {TRUST_FLAG} to accept it"
            )
        return _unpickle(raw)
    from safetensors.torch import load

    try:
        return dict(load(raw))
    except Exception as exc:
        raise WeightSyncError(f"an entry is neither safetensors nor pickled: {exc}") from exc


def _unpickle(raw: bytes) -> dict[str, torch.Tensor]:
    import torch
    from torch.multiprocessing.reductions import ForkingPickler

    try:
        loaded = ForkingPickler.loads(raw)
    except Exception as exc:
        raise WeightSyncError(f"cannot unpickle the payload: {exc}") from exc
    pairs = loaded.items() if isinstance(loaded, dict) else loaded
    try:
        named = {name: tensor for name, tensor in pairs}
    except (TypeError, ValueError) as exc:
        raise WeightSyncError("a pickled payload must hold (name, tensor) pairs") from exc
    if not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in named.items()):
        raise WeightSyncError("a pickled payload must hold (name, tensor) pairs")
    return named


def encode_safetensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """Tensors as one ``serialized_named_tensors`` entry (base64 safetensors)."""
    from safetensors.torch import save

    plain = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return base64.b64encode(save(plain)).decode()
