"""The vllm engine's weight updates, through vLLM's own reload path.

* ``update_weights_from_disk {model_path, weight_version?}``: the worker's
  ``reload_weights`` (``collective_rpc``) reads the folder's safetensors into the live
  model and repacks them as at load, then the prefix cache is reset (its KV came from the
  old weights).
* ``update_weights_from_tensor``: the payload's tensors handed to the same
  ``reload_weights`` as a weights iterator. Writing into a parameter in place would do
  nothing on the CPU: vLLM repacks linear weights at load, and the parameter left behind
  is empty.
* ``update_weight_version`` / ``set_weight_version``: vLLM's weight version.
* The NCCL and NIXL transports (``init_weights_update_group``,
  ``update_weights_from_distributed``, ``update_weights_from_nixl``) are refused with the
  reason: vLLM's weight-transfer engine is not mapped onto them.

Every update needs paused generation (the admin plane pauses first) and awake weights.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import torch

from penstock.engines.controls import Body, ControlRejected, Handler
from penstock.engines.weights.tensor_payloads import decode_payload

TRANSPORT_REFUSAL = (
    "the vllm engine takes weights from disk (update_weights_from_disk) or as tensors "
    "(update_weights_from_tensor); vLLM's weight-transfer engine (NCCL, CUDA IPC) is not "
    "mapped onto {name}"
)


def _reload_from_tensors(worker: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in vLLM's worker process: the tensors through the model's loader."""
    worker.model_runner.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)


def _version(body: Body, field: str) -> str | None:
    version = body.get(field)
    if version is not None and (not isinstance(version, str) or not version):
        raise ControlRejected(f"`{field}` must be a non-empty string", field=field)
    return version


class VllmWeightUpdates:
    """Weight updates on ``AsyncLLM`` (mixed into the engine)."""

    _require_llm: Callable[[], Any]
    _sleep_tags: set[str]

    def weight_updates(self) -> dict[str, Handler]:
        updates: dict[str, Handler] = {
            "update_weights_from_disk": self._update_weights_from_disk,
            "update_weights_from_tensor": self._update_weights_from_tensor,
            "update_weight_version": self._update_weight_version,
            "set_weight_version": self._set_weight_version,
        }
        for name in (
            "init_weights_update_group",
            "update_weights_from_distributed",
            "destroy_weights_update_group",
            "update_weights_from_nixl",
        ):
            updates[name] = self._refusal(name)
        return updates

    @staticmethod
    def _refusal(name: str) -> Handler:
        async def refuse(body: Body) -> Body:
            raise ControlRejected(TRANSPORT_REFUSAL.format(name=name))

        return refuse

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
        llm = await self._writable("update_weights_from_disk")
        try:
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": model_path})
        except Exception as exc:
            raise ControlRejected(f"weight update from {model_path} failed: {exc}") from exc
        return await self._finish(llm, version, f"Weights updated from {model_path}")

    async def _update_weights_from_tensor(self, body: Body) -> Body:
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) != 1:
            raise ControlRejected(
                "'serialized_named_tensors' must hold one entry (this engine has one rank)",
                field="serialized_named_tensors",
            )
        version = _version(body, "weight_version")
        llm = await self._writable("update_weights_from_tensor")
        trusted = body.get("trust_weight_payloads") is True
        try:
            tensors = decode_payload(payloads[0], trusted=trusted, device=torch.device("cpu"))
        except Exception as exc:
            raise ControlRejected(f"update_weights_from_tensor: {exc}") from exc
        if not tensors:
            raise ControlRejected("the payload holds no tensors")
        try:
            await llm.collective_rpc(_reload_from_tensors, args=(list(tensors.items()),))
        except Exception as exc:
            raise ControlRejected(f"weight update from tensors failed: {exc}") from exc
        return await self._finish(llm, version, f"{len(tensors)} tensors updated")

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
