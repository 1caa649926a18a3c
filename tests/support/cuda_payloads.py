"""Pickled payloads that name CUDA tensors, made without CUDA: what a colocated trainer
posts to ``update_weights_from_tensor``, for checking how an engine without CUDA refuses
them. Nothing here opens an IPC handle."""

from __future__ import annotations

import base64
import contextlib
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

LOCAL_SERIALIZED_TENSOR_MODULE = "sglang.srt.model_executor.model_runner"


class CudaTensorReference:
    """Pickles as torch's CUDA rebuild with an IPC handle's arguments."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor, (torch.Tensor, (4,), (1,), 0, None, torch.float32, 0, b"")


def sglang_uuid_cuda_tensor() -> bytes:
    """A CUDA tensor pickled under SGLang's patched reductions: the device named by UUID."""
    with fake_module("sglang.srt.patch_torch") as module:

        def rebuild(*args: Any) -> None:
            raise AssertionError("only its name is pickled")

        rebuild.__module__ = module.__name__
        rebuild.__qualname__ = rebuild.__name__ = "_rebuild_cuda_tensor_modified"
        module._rebuild_cuda_tensor_modified = rebuild  # type: ignore[attr-defined]
        args = (torch.Tensor, (4,), (1,), 0, None, torch.float32, "GPU-0000", b"")

        class Reference:
            def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
                return rebuild, args

        return pickle.dumps(Reference())


@contextlib.contextmanager
def fake_module(path: str) -> Iterator[types.ModuleType]:
    """``path`` (and its parents) importable for the pickler while the block runs."""
    parts = path.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    added = [name for name in names if name not in sys.modules]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
    try:
        yield sys.modules[path]
    finally:
        for name in added:
            sys.modules.pop(name, None)


def local_serialized(values: list[Any]) -> bytes:
    """``[("lm_head.weight", LocalSerializedTensor(values=values))]`` pickled as SGLang's
    class pickles (a ``values`` attribute), without SGLang."""
    with fake_module(LOCAL_SERIALIZED_TENSOR_MODULE) as module:
        cls = type("LocalSerializedTensor", (), {"__module__": module.__name__})
        module.LocalSerializedTensor = cls  # type: ignore[attr-defined]
        entry = cls()
        entry.values = values
        return pickle.dumps([("lm_head.weight", entry)])


def verl_cuda_payload() -> str:
    """What verl and slime post from a colocated trainer: one base64 entry holding
    ``[(name, LocalSerializedTensor(values=[pickled CUDA tensor]))]``."""
    inner = pickle.dumps(CudaTensorReference())
    return base64.b64encode(local_serialized([inner])).decode()
