"""The vllm engine's weight updates, through vLLM's own reload path.

* ``update_weights_from_disk {model_path, weight_version?}``: the worker's
  ``reload_weights`` (``collective_rpc``) reads the folder's safetensors into the live
  model and repacks them as at load. The folder becomes the base of later tensor pushes.
* ``update_weights_from_tensor {serialized_named_tensors, load_format?,
  weight_version?}``: the payload is decoded as for every engine
  (:func:`penstock.engines.weights.tensor_payloads.decode_push`) and checked against the
  base checkpoint's headers (names, shapes, dtypes) and for non-finite values, so a bad
  push is a 400 while the model keeps serving. vLLM's RPC carries no tensors and a
  partial reload leaves the model unloaded, so the tensors travel on disk
  (:mod:`.pushes`): every push since the base, in one overlay file, and Penstock's worker
  method (:mod:`.worker_extension`, installed as vLLM's ``worker_extension_cls``)
  reloads the WHOLE model from the base with the overlay's tensors in place of the
  base's. Nothing is written into a parameter in place (on the CPU vLLM repacks linear
  weights at load and leaves the parameters empty). CUDA tensors shared by IPC handle
  are refused: the gateway's process opens no GPU memory of the trainer's.
* After either update the prefix cache is reset (its KV came from the old weights) and
  ``weight_version``, when given, becomes vLLM's weight version.
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
from typing import Any

from penstock.engines.controls import Body, ControlRejected, Handler
from penstock.engines.vllm.pushes import PushedTensors
from penstock.engines.vllm.worker_extension import (
    EXTENSION_QUALNAME,
    RELOAD_METHOD,
    checkpoint_files,
)
from penstock.engines.weights.sync import WeightSyncError, weights_checksum
from penstock.engines.weights.tensor_payloads import decode_push

TRANSPORT_REFUSAL = (
    "the vllm engine takes weights from disk (update_weights_from_disk) and pushed "
    "tensors (update_weights_from_tensor); vLLM's "
    "weight-transfer engine (NCCL, CUDA IPC) is not mapped onto {name}"
)
FOREIGN_EXTENSION_REFUSAL = (
    "the vllm engine reloads pushed tensors through Penstock's worker extension, and this "
    "server was started with --worker-extension-cls {given}; start it without that "
    "option, or save the checkpoint and call update_weights_from_disk"
)


def _refusal(reason: str) -> Handler:
    async def refuse(body: Body) -> Body:
        raise ControlRejected(reason)

    return refuse


def tensor_names(folder: str) -> set[str]:
    """The tensor names of a folder's safetensors files, from their headers."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in checkpoint_files(folder):
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
    pushed: PushedTensors

    def weight_updates(self) -> dict[str, Handler]:
        updates: dict[str, Handler] = {
            "update_weights_from_disk": self._update_weights_from_disk,
            "update_weight_version": self._update_weight_version,
            "set_weight_version": self._set_weight_version,
        }
        given = self.engine_args.worker_extension_cls
        updates["update_weights_from_tensor"] = (
            self._update_weights_from_tensor
            if given == EXTENSION_QUALNAME
            else _refusal(FOREIGN_EXTENSION_REFUSAL.format(given=given))
        )
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
        self.pushed.rebase(model_path)
        return await self._finish(llm, version, f"Weights updated from {model_path}")

    async def _update_weights_from_tensor(self, body: Body) -> Body:
        version = _version(body, "weight_version")
        trusted = body.get("trust_weight_payloads") is True
        try:
            tensors = await asyncio.to_thread(decode_push, body, trusted=trusted)
            await asyncio.to_thread(self.pushed.check, tensors)
        except WeightSyncError as exc:
            raise ControlRejected(str(exc), field="serialized_named_tensors") from exc
        llm = await self._writable("update_weights_from_tensor")
        staged = await asyncio.to_thread(self.pushed.stage, tensors)
        try:
            await llm.collective_rpc(RELOAD_METHOD, args=(self.pushed.base, str(staged)))
        except Exception as exc:
            self.pushed.discard(staged)
            raise ControlRejected(f"the reload with the pushed tensors failed: {exc}") from exc
        self.pushed.commit(staged)
        dtype = llm.vllm_config.model_config.dtype
        checksum, _ = await asyncio.to_thread(weights_checksum, tensors, dtype)
        answer = await self._finish(llm, version, f"updated {len(tensors)} tensors from tensor")
        return {**answer, "success": True, "tensors": len(tensors), "checksum": checksum}

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
