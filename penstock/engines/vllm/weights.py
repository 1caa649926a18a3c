"""The vllm engine's weight updates, through vLLM's own reload path.

* ``update_weights_from_disk {model_path, weight_version?}``: the worker's
  ``reload_weights`` (``collective_rpc``) reads the folder's safetensors into the live
  model and repacks them as at load, then the prefix cache is reset (its KV came from the
  old weights).
* ``update_weights_from_tensor`` is refused with the reason: the worker's
  ``reload_weights`` takes a weights iterator only inside vLLM's worker process, where
  ``collective_rpc`` delivers neither tensors nor a function of Penstock's, and a reload
  of part of the weights leaves the model unloaded (vLLM's engine then dies). Writing
  into a parameter in place is no way around it: on the CPU vLLM repacks linear weights
  at load and the parameter left behind is empty, so the write does nothing.
* ``update_weight_version`` / ``set_weight_version``: vLLM's weight version.
* The NCCL and NIXL transports (``init_weights_update_group``,
  ``update_weights_from_distributed``, ``update_weights_from_nixl``) are refused with the
  reason: vLLM's weight-transfer engine is not mapped onto them.

Every update needs paused generation (the admin plane pauses first) and awake weights. A
folder that lacks tensors the served checkpoint has is refused before vLLM reads it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from penstock.engines.controls import Body, ControlRejected, Handler

TRANSPORT_REFUSAL = (
    "the vllm engine takes weights from disk (update_weights_from_disk); vLLM's "
    "weight-transfer engine (NCCL, CUDA IPC) is not mapped onto {name}"
)
TENSOR_REFUSAL = (
    "the vllm engine takes no tensor pushes: vLLM reloads weights from an iterator only "
    "inside its worker process, which its RPC cannot hand tensors to, and an in-place write "
    "does nothing on the CPU (its linear weights are repacked); save the checkpoint and "
    "call update_weights_from_disk"
)


def _refusal(reason: str) -> Handler:
    async def refuse(body: Body) -> Body:
        raise ControlRejected(reason)

    return refuse


def tensor_names(folder: str) -> set[str]:
    """The tensor names of a folder's safetensors files, from their headers."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            names.update(file.keys())
    return names


def _version(body: Body, field: str) -> str | None:
    version = body.get(field)
    if version is not None and (not isinstance(version, str) or not version):
        raise ControlRejected(f"`{field}` must be a non-empty string", field=field)
    return version


class VllmWeightUpdates:
    """Weight updates on ``AsyncLLM`` (mixed into the engine)."""

    _require_llm: Callable[[], Any]
    _sleep_tags: set[str]
    engine_args: Any

    def weight_updates(self) -> dict[str, Handler]:
        updates: dict[str, Handler] = {
            "update_weights_from_disk": self._update_weights_from_disk,
            "update_weight_version": self._update_weight_version,
            "set_weight_version": self._set_weight_version,
        }
        updates["update_weights_from_tensor"] = _refusal(TENSOR_REFUSAL)
        for name in (
            "init_weights_update_group",
            "update_weights_from_distributed",
            "destroy_weights_update_group",
            "update_weights_from_nixl",
        ):
            updates[name] = _refusal(TRANSPORT_REFUSAL.format(name=name))
        return updates

    async def _writable(self, update: str) -> Any:
        llm = self._require_llm()
        if not await llm.is_paused():
            raise ControlRejected(
                f"{update} needs paused generation: call pause_generation first, then "
                "resume_generation after the update"
            )
        if "weights" in self._sleep_tags:
            raise ControlRejected(f"the weights are asleep: call wake_up before {update}")
        return llm

    async def _finish(self, llm: Any, version: str | None, message: str) -> Body:
        await llm.reset_prefix_cache()
        if version is not None:
            await llm.update_weight_version(version)
        return {
            "status": "ok",
            "message": message,
            "version": await llm.get_weight_version(),
            "version_declared": version is not None,
        }

    async def _update_weights_from_disk(self, body: Body) -> Body:
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ControlRejected("missing non-empty `model_path` string", field="model_path")
        if not await asyncio.to_thread(os.path.isdir, model_path):
            raise ControlRejected(f"`model_path` {model_path} is not a folder", field="model_path")
        version = _version(body, "weight_version")
        await self._check_complete(model_path)
        llm = await self._writable("update_weights_from_disk")
        try:
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": model_path})
        except Exception as exc:
            raise ControlRejected(f"weight update from {model_path} failed: {exc}") from exc
        return await self._finish(llm, version, f"Weights updated from {model_path}")

    async def _check_complete(self, folder: str) -> None:
        """Refuse a folder that lacks a tensor of the served checkpoint: vLLM would
        leave that weight unloaded and its engine would die."""
        try:
            served = await asyncio.to_thread(tensor_names, str(self.engine_args.model))
            given = await asyncio.to_thread(tensor_names, folder)
        except Exception as exc:
            raise ControlRejected(f"cannot read the safetensors of {folder}: {exc}") from exc
        if not given:
            raise ControlRejected(f"{folder} holds no .safetensors files", field="model_path")
        missing = sorted(served - given)
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ControlRejected(
                f"{folder} lacks {len(missing)} tensor(s) of the served checkpoint "
                f"({shown}); vLLM reloads whole checkpoints",
                field="model_path",
            )

    async def _update_weight_version(self, body: Body) -> Body:
        version = _version(body, "new_version")
        if version is None:
            raise ControlRejected("missing non-empty `new_version` string", field="new_version")
        await self._require_llm().update_weight_version(version)
        return {"status": "ok", "success": True, "new_version": version}

    async def _set_weight_version(self, body: Body) -> Body:
        version = _version(body, "weight_version")
        if version is None:
            raise ControlRejected("Missing 'weight_version' in body", field="weight_version")
        await self._require_llm().update_weight_version(version)
        return {"status": "ok", "version": version}
