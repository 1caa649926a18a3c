"""Penstock's methods on vLLM's worker (vLLM's ``worker_extension_cls``), called by the
gateway through ``AsyncLLM.collective_rpc``.

vLLM's RPC hands its arguments over as plain data (a tensor arrives as a list), so a
tensor push reaches the worker as file paths: the served checkpoint folder (the base)
and a safetensors file of the pushed tensors (the overlay). The worker reloads the whole
model through its own ``reload_weights`` from the base's tensors, each one the overlay
holds replaced by the overlay's: vLLM loads and repacks every weight as at start, and
none is left unloaded (a partial reload would leave the model unusable).

This module runs in vLLM's worker process: it imports nothing of the gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

EXTENSION_QUALNAME = "penstock.engines.vllm.worker_extension.PenstockWorkerExtension"
RELOAD_METHOD = "penstock_reload_with_pushes"


def checkpoint_files(folder: str) -> list[Path]:
    """A checkpoint folder's safetensors files, in name order."""
    return sorted(Path(folder).glob("*.safetensors"))


def tensors_with_pushes(base: str, pushed: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint in ``base``, the ones ``pushed`` holds taken from it."""
    from safetensors import safe_open

    with safe_open(pushed, framework="pt") as overlay:
        replaced = set(overlay.keys())
        for path in checkpoint_files(base):
            with safe_open(str(path), framework="pt") as file:
                for name in file.keys():
                    source = overlay if name in replaced else file
                    yield name, source.get_tensor(name)


class PenstockWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (its names must not clash with the worker's)."""

    reload_weights: Any

    def penstock_reload_with_pushes(self, base: str, pushed: str) -> None:
        self.reload_weights(
            weights_iterator=tensors_with_pushes(base, pushed), is_checkpoint_format=True
        )
