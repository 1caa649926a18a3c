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
one 1-D tensor, concatenated in ``names`` order. With ``load_format: "packed"`` (vLLM's
packed broadcast, ``packed_tensor.py``) each tensor's raw bytes are concatenated in
``names`` order, dtypes mixed, and cut into buffers: a buffer closes once its running
total exceeds ``packed_buffer_size_bytes`` (default 1 GiB), so it ends with the tensor
that crossed the limit; each buffer travels as one ``uint8`` broadcast.

**Tensor payloads** (``update_weights_from_tensor``): each entry of
``serialized_named_tensors`` is base64 text of a safetensors file (the default and the
only form accepted unless the operator trusts payloads). A pickled payload (what
``MultiprocessingSerializer`` produces with ``multiprocessing``'s ``ForkingPickler``: a
list of ``(name, tensor)`` pairs, or a dict; on the same host its tensors may live in
shared memory: CUDA tensors by IPC handle, CPU tensors by shared-memory file name under
torch's ``file_system`` sharing strategy) is unpickled only with
``--trust-weight-payloads``, since unpickling runs code the sender chose. Decoding is in
:mod:`penstock.engines.weights.tensor_payloads`.

**NIXL pull** (``update_weights_from_nixl``): the trainer registers its tensors with a
NIXL agent (UCX) and posts ``agent_name``, ``agent_metadata`` (base64 of the agent's
metadata, taken after registering), ``names``/``dtypes``/``shapes`` as for a broadcast,
``descriptors`` (one ``[address, nbytes, device_id]`` per name, ``nbytes`` equal to the
declared shape times the dtype's size), ``mem_type`` (``DRAM``, the default, or
``VRAM``) and an optional ``notify`` tag. The engine validates everything, then READs
the bytes straight into its parameters (through a bounded scratch buffer when it holds
a tensor in another dtype); its last READ carries ``notify`` (default
``penstock-weights``), which tells the trainer its memory is free. The engine keeps the
trainer's agent loaded between pushes (refreshing its metadata each time).

Torch is imported inside the functions that need it: the gateway imports this module.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_GROUP_NAME = "weight_update_group"
# vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES: both ends must cut buffers at the same size.
DEFAULT_PACKED_BUFFER_BYTES = 1024 * 1024 * 1024
DEFAULT_NIXL_NOTIFY = "penstock-weights"
NIXL_MEM_TYPES = ("DRAM", "VRAM")
TRUST_FLAG = "--trust-weight-payloads"
# Pickle protocols 2..5 open with PROTO (0x80) and the protocol number.
_PICKLE_PREFIXES = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
# How peft names a LoRA matrix in a saved adapter: under the wrapped model, without the
# adapter's own name (a training model's parameter holds it: ``lora_A.default.weight``).
PEFT_PREFIX = "base_model.model."
_LORA_MATRIX = re.compile(r"^(?P<module>.+)\.(?P<part>lora_[AB])(?:\.[^.]+)?\.weight$")
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
    # Hashed through the buffer protocol: no copy of the bytes.
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


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


def lora_file_key(name: str) -> str:
    """The key peft saves the broadcast LoRA matrix ``name`` under (a parameter name of a
    training peft model, with or without the adapter's name and peft's prefix)."""
    match = _LORA_MATRIX.match(name)
    if match is None:
        raise WeightSyncError(f"{name!r} is not a LoRA A or B matrix (<module>.lora_A.weight)")
    module = match["module"]
    if not module.startswith(PEFT_PREFIX):
        module = PEFT_PREFIX + module
    return f"{module}.{match['part']}.weight"


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


def spec_bytes(spec: TensorSpec) -> int:
    return _numel(spec.shape) * parse_dtype(spec.dtype).itemsize


def packed_buffers(specs: list[TensorSpec], buffer_bytes: int) -> list[list[TensorSpec]]:
    """vLLM's cut of a packed broadcast: tensors join a buffer in order until its byte
    total exceeds ``buffer_bytes``; the tensor that crossed it is the buffer's last."""
    buffers: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    total = 0
    for spec in specs:
        current.append(spec)
        total += spec_bytes(spec)
        if total > buffer_bytes:
            buffers.append(current)
            current, total = [], 0
    if current:
        buffers.append(current)
    return buffers


def _receive_packed(
    group: Any, specs: list[TensorSpec], device: torch.device, buffer_bytes: int, sink: Any
) -> None:
    import torch
    import torch.distributed as dist

    for chunk in packed_buffers(specs, buffer_bytes):
        sizes = [spec_bytes(spec) for spec in chunk]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=0, group=group)
        for spec, part in zip(chunk, buffer.split(sizes), strict=True):
            dtype = parse_dtype(spec.dtype)
            # A view as a wider dtype needs an aligned offset: mixed dtypes may break it.
            if part.storage_offset() % dtype.itemsize:
                part = part.clone()
            sink(spec, part.view(dtype).view(spec.shape))


def broadcast_specs(
    group: Any,
    specs: list[TensorSpec],
    *,
    device: torch.device,
    flattened: bool,
    sink: Any,
    packed_bytes: int | None = None,
) -> None:
    """Receive ``specs`` from rank 0; ``sink(spec, tensor)`` takes each one as it lands.
    ``packed_bytes`` receives vLLM's packed buffers of that size (see the module)."""
    import torch
    import torch.distributed as dist

    if packed_bytes is not None:
        _receive_packed(group, specs, device, packed_bytes, sink)
        return
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


def encode_safetensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """Tensors as one ``serialized_named_tensors`` entry (base64 safetensors)."""
    from safetensors.torch import save

    plain = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return base64.b64encode(save(plain)).decode()


@dataclass(frozen=True)
class NixlPull:
    """A validated ``update_weights_from_nixl`` body."""

    agent_name: str
    agent_metadata: bytes
    specs: list[TensorSpec]
    descriptors: list[tuple[int, int, int]]
    mem_type: str
    notify: bytes


def parse_nixl_pull(body: Mapping[str, Any]) -> NixlPull:
    """Every field checked, sizes included, before any memory is touched."""
    agent_name = body.get("agent_name")
    if not isinstance(agent_name, str) or not agent_name:
        raise WeightSyncError("'agent_name' must be the trainer's NIXL agent name")
    encoded = body.get("agent_metadata")
    try:
        if not isinstance(encoded, str) or not encoded:
            raise ValueError("missing")
        metadata = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WeightSyncError(
            "'agent_metadata' must be base64 of the trainer agent's NIXL metadata"
        ) from exc
    specs = parse_specs(body)
    mem_type = body.get("mem_type", "DRAM")
    if mem_type not in NIXL_MEM_TYPES:
        raise WeightSyncError(f"'mem_type' must be one of {', '.join(NIXL_MEM_TYPES)}")
    notify = body.get("notify", DEFAULT_NIXL_NOTIFY)
    if not isinstance(notify, str) or not notify:
        raise WeightSyncError("'notify' must be a non-empty string")
    raw = body.get("descriptors")
    if not isinstance(raw, list) or len(raw) != len(specs):
        raise WeightSyncError(
            f"'descriptors' must hold one [address, nbytes, device_id] per name ({len(specs)})"
        )
    descriptors = []
    for spec, entry in zip(specs, raw, strict=True):
        if (
            not isinstance(entry, list)
            or len(entry) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)
        ):
            raise WeightSyncError(
                f"'descriptors' of {spec.name} must be [address, nbytes, device_id]"
            )
        address, nbytes, device_id = entry
        expected = _numel(spec.shape) * parse_dtype(spec.dtype).itemsize
        if nbytes != expected:
            raise WeightSyncError(
                f"'descriptors' of {spec.name}: {nbytes} bytes, but shape {list(spec.shape)} "
                f"of {spec.dtype} is {expected}"
            )
        if address == 0 and nbytes:
            raise WeightSyncError(f"'descriptors' of {spec.name}: address 0")
        descriptors.append((address, nbytes, device_id))
    return NixlPull(agent_name, metadata, specs, descriptors, mem_type, notify.encode())


def nixl_pull_body(
    agent_name: str,
    metadata: bytes,
    tensors: Mapping[str, torch.Tensor],
    notify: str = DEFAULT_NIXL_NOTIFY,
) -> dict[str, Any]:
    """The ``update_weights_from_nixl`` body for registered, contiguous ``tensors``."""
    from penstock.nixl_agent import mem_type_of

    items = list(tensors.items())
    kinds = {mem_type_of(t)[0] for _, t in items}
    if len(kinds) != 1:
        raise WeightSyncError("one NIXL push holds tensors of one memory type")
    return {
        "agent_name": agent_name,
        "agent_metadata": base64.b64encode(metadata).decode(),
        "names": [name for name, _ in items],
        "dtypes": [dtype_name(t.dtype) for _, t in items],
        "shapes": [list(t.shape) for _, t in items],
        "descriptors": [[t.data_ptr(), t.nbytes, mem_type_of(t)[1]] for _, t in items],
        "mem_type": kinds.pop(),
        "notify": notify,
    }


def distinct_regions(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each memory region once (tied weights share theirs): NIXL registers a region once."""
    seen: set[tuple[int, int, int]] = set()
    regions = []
    for tensor in tensors:
        key = (tensor.data_ptr(), tensor.nbytes, tensor.get_device())
        if key not in seen:
            seen.add(key)
            regions.append(tensor)
    return regions


class NixlPuller:
    """The engine's NIXL agent (made on the first pull) and the READs into its memory."""

    def __init__(self) -> None:
        self._agent: Any = None

    def read(
        self, pull: NixlPull, indices: list[int], into: list[torch.Tensor], last: bool
    ) -> None:
        """READ the descriptors at ``indices`` into the contiguous tensors ``into``.

        A descriptor outside the trainer's registered memory is refused by NIXL before
        any byte moves (:class:`WeightSyncError`); a READ that fails midway raises
        :class:`RuntimeError`.
        """
        from penstock.nixl_agent import NixlAgent, mem_type_of

        if self._agent is None:
            # Only this side starts transfers, and it polls them to the end.
            self._agent = NixlAgent("weights", progress_thread=False)
        agent = self._agent
        try:
            peer = agent.add_remote(pull.agent_metadata)
        except Exception as exc:
            raise WeightSyncError(f"'agent_metadata' is not NIXL agent metadata: {exc}") from exc
        if peer != pull.agent_name:
            raise WeightSyncError(
                f"'agent_metadata' belongs to agent {peer!r}, not 'agent_name' {pull.agent_name!r}"
            )
        kind, device_id = mem_type_of(into[0])
        registration = agent.agent.register_memory(distinct_regions(into))
        try:
            local = agent.agent.get_xfer_descs(
                [(t.data_ptr(), t.nbytes, device_id) for t in into], kind
            )
            remote = agent.agent.get_xfer_descs(
                [pull.descriptors[i] for i in indices], pull.mem_type
            )
            try:
                handle = agent.agent.initialize_xfer(
                    "READ", local, remote, peer, pull.notify if last else b""
                )
            except Exception as exc:
                raise WeightSyncError(
                    f"NIXL refused the descriptors (are they in memory agent {peer!r} "
                    f"registered?): {exc}"
                ) from exc
            if not agent.run_blocking(handle):
                raise RuntimeError(f"the NIXL READ from agent {peer!r} failed")
        finally:
            agent.agent.deregister_memory(registration)

    def close(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            for remote in list(agent.remotes):
                agent.forget(remote)
