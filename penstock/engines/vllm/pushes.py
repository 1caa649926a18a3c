"""The tensors pushed to the vllm engine since its last checkpoint, kept on disk for
vLLM's worker to reload from (:mod:`.worker_extension`).

The base is the checkpoint folder the model last loaded whole (the served folder, then
that of each disk update); the overlay is one safetensors file of every tensor pushed
since, the latest push of a name winning. Each push writes a new overlay file beside the
current one, in a folder of Penstock's own (removed when the engine stops); the new file
replaces the current one only once vLLM has reloaded from it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from penstock.engines.vllm.worker_extension import checkpoint_files
from penstock.engines.weights.sync import TensorSpec, WeightSyncError, check_against, dtype_name

# safetensors' dtype names, as its headers give them.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def checkpoint_meta(folder: str) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder as shapes and dtypes (meta tensors), from the
    safetensors headers."""
    from safetensors import safe_open

    meta: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():
                part = file.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
                meta[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    return meta


class PushedTensors:
    """The base checkpoint folder and the overlay of tensors pushed since."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.overlay: Path | None = None
        self._folder: Path | None = None
        self._written = 0

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse unknown names, other shapes, dtypes that cannot load, and non-finite
        values, all before anything is written or reloaded."""
        specs = [
            TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()
        ]
        check_against(specs, checkpoint_meta(self.base))
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise WeightSyncError(f"{name} holds NaN or infinite values")

    def stage(self, tensors: dict[str, torch.Tensor]) -> Path:
        """A new overlay file: the current overlay's tensors with ``tensors`` over them."""
        from safetensors.torch import load_file, save_file

        merged = load_file(str(self.overlay)) if self.overlay is not None else {}
        merged.update({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="penstock-vllm-pushes-"))
        self._written += 1
        staged = self._folder / f"pushed-{self._written}.safetensors"
        save_file(merged, str(staged), metadata={"format": "pt"})
        return staged

    def commit(self, staged: Path) -> None:
        """``staged`` is what the model now holds over the base."""
        if self.overlay is not None:
            self.overlay.unlink(missing_ok=True)
        self.overlay = staged

    @staticmethod
    def discard(staged: Path) -> None:
        staged.unlink(missing_ok=True)

    def rebase(self, folder: str) -> None:
        """The model now holds ``folder``'s checkpoint whole: nothing pushed is over it."""
        self.base = folder
        if self.overlay is not None:
            self.overlay.unlink(missing_ok=True)
        self.overlay = None

    def close(self) -> None:
        if self._folder is not None and os.path.isdir(self._folder):
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = self.overlay = None
