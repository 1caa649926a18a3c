"""``serialized_named_tensors`` entries (``update_weights_from_tensor``) as tensors.

An entry is base64 text of a safetensors file, or, on a server started with
``--trust-weight-payloads``, of a pickle (the formats are in
:mod:`penstock.engines.weights.sync`).

**CUDA-IPC payloads** (colocated trainers, as verl and slime drive SGLang): a pickled CUDA
tensor carries an IPC handle to the sender's GPU memory, which only a process on the same
GPU can open; the engine must run on that device. An entry may hold the tensors
themselves, or, per name, SGLang's ``LocalSerializedTensor`` (``values``: one pickled
tensor per tensor-parallel rank of the engine; this engine takes exactly one). SGLang's
patched reductions name the device by UUID instead of index; both are understood. On an
engine without CUDA, a payload naming a CUDA rebuild is refused before anything of it
runs, with the reason.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from penstock.engines.weights.sync import (
    TRUST_FLAG,
    UntrustedPayloadError,
    WeightSyncError,
    is_pickled,
)

if TYPE_CHECKING:
    import torch

_TORCH_CUDA_REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
# SGLang's patched reduction of a CUDA tensor, and where its arguments hold the device.
_SGLANG_CUDA_REBUILD = "_rebuild_cuda_tensor_modified"
_REBUILD_DEVICE_ARG = 6


def decode_payload(
    text: Any, *, trusted: bool, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """One ``serialized_named_tensors`` entry as ``{name: tensor}``; ``device`` is the
    engine's, where a pickled CUDA tensor must live."""
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
        return _unpickle(raw, device)
    from safetensors.torch import load

    try:
        return dict(load(raw))
    except Exception as exc:
        raise WeightSyncError(f"an entry is neither safetensors nor pickled: {exc}") from exc


def decode_push(
    body: Mapping[str, Any], *, trusted: bool, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """An ``update_weights_from_tensor`` body's tensors: one ``serialized_named_tensors``
    entry (one tensor-parallel rank), ``load_format`` direct or safetensors, not empty."""
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads:
        raise WeightSyncError("'serialized_named_tensors' must be a non-empty list")
    if len(payloads) != 1:
        raise WeightSyncError(
            f"'serialized_named_tensors' holds {len(payloads)} entries (one per tensor "
            "parallel rank); this engine has one rank"
        )
    load_format = body.get("load_format")
    if load_format not in (None, "direct", "safetensors"):
        raise WeightSyncError(f"'load_format' must be direct or safetensors; got {load_format!r}")
    tensors = decode_payload(payloads[0], trusted=trusted, device=device)
    if not tensors:
        raise WeightSyncError("the payload holds no tensors")
    return tensors


class RankTensors:
    """SGLang's ``LocalSerializedTensor`` as it unpickles here: ``values`` holds one
    pickled tensor per tensor-parallel rank of the receiving engine."""

    values: list[Any]


class _PayloadUnpickler(pickle.Unpickler):
    """Pickle's own unpickler, except for SGLang's classes (no SGLang import) and CUDA
    rebuilds, refused before they run unless the engine is on CUDA."""

    def __init__(self, raw: bytes, device: torch.device | None) -> None:
        super().__init__(io.BytesIO(raw))
        self.device = device

    def find_class(self, module: str, name: str) -> Any:
        from_sglang = module.split(".")[0] == "sglang"
        if from_sglang and name == "LocalSerializedTensor":
            return RankTensors
        if (module, name) == _TORCH_CUDA_REBUILD or (from_sglang and name == _SGLANG_CUDA_REBUILD):
            self._require_cuda()
            return _rebuild_by_uuid if from_sglang else super().find_class(module, name)
        return super().find_class(module, name)

    def _require_cuda(self) -> None:
        if self.device is None or self.device.type != "cuda":
            where = "the CPU" if self.device is None else f"{self.device}"
            raise WeightSyncError(
                "the payload holds CUDA tensors shared by IPC handle, which only a process "
                f"on the sender's GPU can open, and this engine runs on {where}: send "
                "safetensors bytes, or CPU tensors pickled under the file_system sharing "
                "strategy"
            )


def _rebuild_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's CUDA rebuild: the device named by UUID, opened here by its index."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    named = args[_REBUILD_DEVICE_ARG]
    if isinstance(named, str):
        found = [
            index
            for index in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(index).uuid) == named
        ]
        if not found:
            raise WeightSyncError(f"the payload's GPU {named} is not visible to this engine")
        args = (*args[:_REBUILD_DEVICE_ARG], found[0], *args[_REBUILD_DEVICE_ARG + 1 :])
    return rebuild_cuda_tensor(*args)


def _load_pickle(raw: bytes, device: torch.device | None) -> Any:
    # torch's rebuild functions, which the payload names, are imported by the unpickler.
    from multiprocessing import AuthenticationError

    try:
        return _PayloadUnpickler(raw, device).load()
    except WeightSyncError:
        raise
    except AuthenticationError as exc:
        # torch's default "file_descriptor" strategy hands a CPU tensor over through the
        # sender's resource sharer, which answers only processes of its own family.
        raise WeightSyncError(
            "cannot unpickle the payload: its CPU tensors are shared by file descriptor, "
            "which only a process started by the sender can receive; pickle them after "
            "torch.multiprocessing.set_sharing_strategy('file_system'), or send "
            "safetensors bytes"
        ) from exc
    except Exception as exc:
        raise WeightSyncError(f"cannot unpickle the payload: {exc}") from exc


def _unpickle(raw: bytes, device: torch.device | None) -> dict[str, torch.Tensor]:
    import torch

    loaded = _load_pickle(raw, device)
    pairs = loaded.items() if isinstance(loaded, dict) else loaded
    try:
        named = {name: _one_rank(name, value, device) for name, value in pairs}
    except WeightSyncError:
        raise
    except (TypeError, ValueError) as exc:
        raise WeightSyncError("a pickled payload must hold (name, tensor) pairs") from exc
    if not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in named.items()):
        raise WeightSyncError("a pickled payload must hold (name, tensor) pairs")
    for name, tensor in named.items():
        if tensor.is_cuda and not _is_engine_gpu(tensor.device, device):
            raise WeightSyncError(
                f"{name} is on {tensor.device}, and this engine on {device}: a CUDA-IPC "
                "push comes from a trainer on the engine's own GPU"
            )
    return named


def _is_engine_gpu(found: torch.device, device: torch.device | None) -> bool:
    import torch

    if device is None or device.type != "cuda":
        return False
    # The engine's device may be plain "cuda": the current device, in every thread here.
    index = torch.cuda.current_device() if device.index is None else device.index
    return found.index == index


def _one_rank(name: Any, value: Any, device: torch.device | None) -> Any:
    """A tensor as sent, or the one rank's tensor of a ``LocalSerializedTensor``."""
    if not isinstance(value, RankTensors):
        return value
    values = getattr(value, "values", None)
    if not isinstance(values, list) or len(values) != 1:
        count = len(values) if isinstance(values, list) else "no"
        raise WeightSyncError(
            f"{name}: a LocalSerializedTensor holds {count} ranks' tensors; this engine has "
            "one rank"
        )
    inner = values[0]
    if isinstance(inner, str):
        try:
            inner = base64.b64decode(inner, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WeightSyncError(f"{name}: its rank's tensor is not valid base64") from exc
    if not isinstance(inner, bytes) or not is_pickled(inner):
        raise WeightSyncError(f"{name}: its rank's tensor is not a pickled tensor")
    return _load_pickle(inner, device)
