"""Weight pushes into the live model: collective broadcast, tensor payloads, NIXL pulls,
verification.

The wire formats and the checksum are in :mod:`penstock.engines.weights.sync`. Every push
needs paused generation and is validated whole (names, shapes, dtypes) before the first
byte is received; a refused push leaves the old weights serving. A broadcast whose
metadata is valid for the wire but not for this model is still received (into a scratch
buffer, one tensor at a time, then dropped), so the trainer's collective completes and
the group stays usable for its next push.

Weights are never served half-updated: every pushed tensor is staged in a buffer of its
own (on the model's device, in the dtype it was sent in) until the whole push has
arrived, and only then copied into the parameters, all of them under the scheduler's step
lock. A transfer that breaks midway (the trainer died during a broadcast, a NIXL READ
failed) drops what was staged and fails the update with a message saying so; the live
tensors were never written, the weight version stays, and generation stays paused for
the trainer to push again (after re-creating a broken group). Staging costs the pushed
tensors' size once more while a push runs.

Level-2 sleep drops pushed weights as it drops any (vLLM's rule): ``wake_up`` restores
the last checkpoint read from disk, and the trainer pushes again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from penstock.engines.controls import WeightsByName, parse_tensor_names
from penstock.engines.transformers.weights.checkpoint import checkpoint_state_dict
from penstock.engines.weights.sync import (
    DEFAULT_GROUP_NAME,
    DEFAULT_PACKED_BUFFER_BYTES,
    NixlPuller,
    TensorSpec,
    WeightSyncError,
    check_against,
    destroy_process_group,
    dtype_name,
    init_custom_process_group,
    parse_dtype,
    parse_nixl_pull,
    parse_specs,
    weights_checksum,
)
from penstock.engines.weights.tensor_payloads import decode_push

Body = dict[str, Any]
DEFAULT_INIT_TIMEOUT_S = 30.0
BACKENDS = ("gloo", "nccl")
# The spread of ``reset_weights``' values: a freshly initialised layer's.
RESET_STD = 0.02


@dataclass
class _Group:
    handle: Any
    rank: int
    world_size: int
    backend: str


def _int(body: Body, field: str, default: int | None = None, *, low: int = 0) -> int:
    value = body.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise WeightSyncError(f"'{field}' must be an integer >= {low}; got {value!r}")
    return value


def _str(body: Body, field: str, default: str | None = None) -> str:
    value = body.get(field, default)
    if not isinstance(value, str) or not value:
        raise WeightSyncError(f"'{field}' must be a non-empty string; got {value!r}")
    return value


class WeightSync:
    """The update groups of one engine and the pushes through them."""

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        self.puller = NixlPuller()

    # -- groups ---------------------------------------------------------------------

    def init_group(self, body: Body, device: torch.device) -> Body:
        group_name = _str(body, "group_name", DEFAULT_GROUP_NAME)
        backend = _str(body, "backend", "nccl" if device.type == "cuda" else "gloo")
        if backend not in BACKENDS:
            raise WeightSyncError(f"'backend' must be one of {', '.join(BACKENDS)}")
        if backend == "nccl" and device.type != "cuda":
            raise WeightSyncError(
                "'backend' nccl needs the engine on CUDA, and this engine runs on the CPU, "
                "where gloo is the backend it can join: send backend gloo"
            )
        world_size = _int(body, "world_size", low=2)
        rank = _int(body, "rank_offset", 1, low=1)
        if rank >= world_size:
            raise WeightSyncError(f"'rank_offset' {rank} must be below 'world_size' {world_size}")
        if group_name in self.groups:
            raise WeightSyncError(
                f"group '{group_name}' already exists: destroy_weights_update_group first"
            )
        timeout = body.get("timeout_s", DEFAULT_INIT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise WeightSyncError("'timeout_s' must be a positive number")
        try:
            handle = init_custom_process_group(
                backend=backend,
                master_address=_str(body, "master_address"),
                master_port=_int(body, "master_port", low=1),
                rank=rank,
                world_size=world_size,
                group_name=group_name,
                timeout_s=float(timeout),
            )
        except WeightSyncError:
            raise
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise WeightSyncError(
                f"could not join group '{group_name}' within {timeout:g}s (did the trainer "
                f"join as rank 0?): {first}"
            ) from exc
        self.groups[group_name] = _Group(handle, rank, world_size, backend)
        return {
            "status": "ok",
            "success": True,
            "message": f"joined group '{group_name}' as rank {rank} of {world_size} ({backend})",
        }

    def destroy_group(self, body: Body) -> Body:
        group_name = _str(body, "group_name", DEFAULT_GROUP_NAME)
        group = self.groups.pop(group_name, None)
        if group is None:
            raise WeightSyncError(
                f"no group '{group_name}'; known: {sorted(self.groups) or 'none'}"
            )
        destroy_process_group(group.handle)
        return {"status": "ok", "success": True, "message": f"group '{group_name}' destroyed"}

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group({"group_name": name})
        self.puller.close()

    def _group(self, body: Body) -> _Group:
        name = body.get("group_name")
        if name is None and len(self.groups) == 1:
            return next(iter(self.groups.values()))
        name = _str(body, "group_name", DEFAULT_GROUP_NAME)
        group = self.groups.get(name)
        if group is None:
            raise WeightSyncError(
                f"no weights update group '{name}': call init_weights_update_group first"
            )
        return group

    # -- pushes -------------------------------------------------------------------------

    def receive(self, model: torch.nn.Module, body: Body, device: torch.device, lock: Any) -> Body:
        """``update_weights_from_distributed``: validate, then receive into the model."""
        from penstock.engines.weights.sync import broadcast_specs

        group = self._group(body)
        specs = parse_specs(body)
        layout = _layout(body)
        live = checkpoint_state_dict(model)
        try:
            check_against(specs, live)
        except WeightSyncError:
            # Drain what the trainer is already sending, so its collective completes.
            broadcast_specs(
                group.handle, specs, device=device, sink=lambda spec, tensor: None, **layout
            )
            raise
        staged = _stage_broadcast(
            group.handle, specs, device, on_cpu=False, lost="none was applied", **layout
        )
        written = _swap_in(staged, live, lock)
        return self._done(written, "distributed")

    def receive_adapter(
        self, body: Body, device: torch.device, check: Callable[[list[TensorSpec]], None]
    ) -> dict[str, torch.Tensor]:
        """A LoRA adapter's tensors broadcast as ``update_weights_from_distributed``'s
        (one at a time, in ``names`` order), all staged on the CPU before any is returned;
        nothing of the model is written. Specs that ``check`` refuses are still received
        and dropped, so the trainer's collective completes."""
        from penstock.engines.weights.sync import broadcast_specs

        group = self._group(body)
        specs = parse_specs(body)
        try:
            check(specs)
        except ValueError:
            broadcast_specs(
                group.handle, specs, device=device, flattened=False, sink=lambda s, t: None
            )
            raise
        return _stage_broadcast(
            group.handle, specs, device, flattened=False, on_cpu=True, lost="no adapter was loaded"
        )

    def load_tensors(self, model: torch.nn.Module, body: Body, *, trusted: bool, lock: Any) -> Body:
        """``update_weights_from_tensor``: decode every entry, validate, then copy.

        CUDA tensors shared by IPC handle (on the model's own GPU) are read in place from
        the trainer's memory; the copy ends before the answer, so the trainer may reuse
        that memory once it has it."""
        live = checkpoint_state_dict(model)
        device = next(iter(live.values())).device
        tensors = decode_push(body, trusted=trusted, device=device)
        specs = [
            TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()
        ]
        check_against(specs, live)
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise WeightSyncError(f"{name} holds NaN or infinite values")
        written = _swap_in(tensors, live, lock)
        if any(tensor.is_cuda for tensor in tensors.values()):
            torch.cuda.synchronize(device)
        return self._done(written, "tensor")

    def pull_nixl(self, model: torch.nn.Module, body: Body, *, lock: Any) -> Body:
        """``update_weights_from_nixl``: validate, then READ from the trainer's memory."""
        pull = parse_nixl_pull(body)
        live = checkpoint_state_dict(model)
        check_against(pull.specs, live)
        staged = {
            spec.name: torch.empty(
                spec.shape, dtype=parse_dtype(spec.dtype), device=live[spec.name].device
            )
            for spec in pull.specs
        }
        try:
            self.puller.read(pull, list(range(len(pull.specs))), list(staged.values()), last=True)
        except RuntimeError as exc:
            raise WeightSyncError(
                f"the NIXL pull of {len(pull.specs)} tensors broke ({_first_line(exc)}); "
                "none was applied: push again"
            ) from exc
        written = _swap_in(staged, live, lock)
        return self._done(written, "nixl")

    @staticmethod
    def _done(written: dict[str, torch.Tensor], how: str) -> Body:
        checksum, _ = weights_checksum(written)
        return {
            "status": "ok",
            "success": True,
            "message": f"updated {len(written)} tensors from {how}",
            "tensors": len(written),
            "checksum": checksum,
        }


def _swap_in(
    staged: dict[str, torch.Tensor], live: dict[str, torch.Tensor], lock: Any
) -> dict[str, torch.Tensor]:
    """Copy every staged tensor into its live one, between two forward passes."""
    with lock, torch.no_grad():
        for name, tensor in staged.items():
            live[name].copy_(tensor)
    return {name: live[name] for name in staged}


def _layout(body: Body) -> dict[str, Any]:
    """How a broadcast's tensors travel (``load_format``), as ``broadcast_specs`` takes it."""
    load_format = body.get("load_format")
    if load_format not in (None, "direct", "flattened_bucket", "packed"):
        raise WeightSyncError(
            f"'load_format' must be direct, flattened_bucket or packed; got {load_format!r}"
        )
    packed_bytes = None
    if load_format == "packed":
        packed_bytes = _int(body, "packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES, low=1)
    return {"flattened": load_format == "flattened_bucket", "packed_bytes": packed_bytes}


def _stage_broadcast(
    handle: Any,
    specs: list[TensorSpec],
    device: torch.device,
    *,
    flattened: bool,
    on_cpu: bool,
    lost: str,
    packed_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``specs`` received over the group, held aside (on the CPU when
    ``on_cpu``) until the last arrives; a broadcast that breaks part-way raises, saying
    what arrived and (``lost``) that nothing of it was used."""
    from penstock.engines.weights.sync import broadcast_specs

    staged: dict[str, torch.Tensor] = {}

    def stage(spec: TensorSpec, tensor: torch.Tensor) -> None:
        staged[spec.name] = tensor.cpu() if on_cpu else tensor

    try:
        broadcast_specs(
            handle, specs, device=device, flattened=flattened, sink=stage, packed_bytes=packed_bytes
        )
    except Exception as exc:
        raise WeightSyncError(
            f"the broadcast broke after {len(staged)} of {len(specs)} tensors arrived "
            f"({_first_line(exc)}); {lost}: re-create the weights update group and push again"
        ) from exc
    return staged


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def checksum_control(model: torch.nn.Module, body: Body) -> Body:
    """``weights_checksum {names?}``: the checksum of the named tensors (default: all)."""
    live = checkpoint_state_dict(model)
    names = parse_tensor_names(body)
    if names is None:
        chosen = live
    else:
        unknown = sorted(set(names) - set(live))
        if unknown:
            raise WeightSyncError(f"'names': not tensors of this model: {', '.join(unknown[:5])}")
        chosen = {name: live[name] for name in names}
    checksum, digests = weights_checksum(chosen)
    return {"status": "ok", "checksum": checksum, "tensors": digests}


def weights_by_name(model: torch.nn.Module, wanted: WeightsByName) -> Body:
    """``get_weights_by_name``: the tensor's first ``truncate_size`` rows, as SGLang answers
    (a 1-D tensor's first values; a 0-D one its value)."""
    tensor = checkpoint_state_dict(model).get(wanted.name)
    if tensor is None:
        raise WeightSyncError(f"'name': {wanted.name} is not a tensor of this model")
    rows = tensor.detach()
    rows = rows.reshape(1) if rows.dim() == 0 else rows[: wanted.truncate_size]
    return {
        "status": "ok",
        "name": wanted.name,
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "values": rows.to("cpu", torch.float64).tolist(),
    }


def randomize_weights(model: torch.nn.Module) -> None:
    """``reset_weights``: every checkpoint tensor overwritten with random values (call with
    the scheduler's step lock held)."""
    with torch.no_grad():
        for tensor in checkpoint_state_dict(model).values():
            if tensor.is_floating_point():
                tensor.normal_(0.0, RESET_STD)
            else:
                tensor.random_(0, 2)
