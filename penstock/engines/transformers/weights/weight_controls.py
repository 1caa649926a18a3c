"""The transformers engine's weight controls and updates: from disk, the pushes of
:mod:`.sync` (collective broadcast, tensor payloads, NIXL pulls), their checks, versions,
and the snapshot a Ray fleet rolls back to.

Every update needs paused generation and awake weights; a refused one leaves the previous
weights serving. ``receive_lora_adapter`` (AReaL's LoRA broadcast) writes no weights: it
receives an adapter's tensors over an update group into a folder, which the gateway then
loads as any adapter. ``reset_weights`` (SGLang's ``reset_tensors``) overwrites every tensor
with random values, paused or not: a trainer checks afterwards that its push rewrote them
all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from penstock.engines import controls
from penstock.engines.controls import Body, ControlRejected, Handler
from penstock.engines.transformers.features.lora import LoraError, lora_config, save_adapter
from penstock.engines.transformers.weights.checkpoint import (
    CheckpointError,
    apply_weight_update,
    plan_weight_update,
    read_safetensors,
)
from penstock.engines.transformers.weights.cpu_weights import requantize
from penstock.engines.transformers.weights.sync import (
    checksum_control,
    randomize_weights,
    weights_by_name,
)
from penstock.engines.weights.sync import TensorSpec, WeightSyncError, lora_file_key
from penstock.nixl_agent import nixl_installed

if TYPE_CHECKING:
    from penstock.engines.transformers.core.scheduler import BatchScheduler
    from penstock.engines.transformers.features.vision import VisionEncoder
    from penstock.engines.transformers.weights.sync import WeightSync

Snapshot = tuple[dict[str, torch.Tensor], str | None, Path | None]


def _optional_version(body: Body, field: str = "weight_version") -> str | None:
    version = body.get(field)
    if version is not None and not isinstance(version, str):
        raise ControlRejected(f"`{field}` must be a string", field=field)
    return version


class TransformersWeightControls:
    """Weight updates, checks and versions (mixed into the engine)."""

    model: Any
    int8_weights: bool
    gguf_weights: bool
    vision: VisionEncoder | None
    weight_sync: WeightSync
    weight_version: str | None
    _weights_source: Path | None
    _sleeping: set[str]
    _require_scheduler: Callable[[], BatchScheduler]
    _placement: Callable[[], tuple[torch.device, torch.dtype]]

    def weight_controls(self) -> dict[str, Handler]:
        return {
            controls.GET_WEIGHT_VERSION: self._get_weight_version,
            controls.WEIGHTS_CHECKSUM: self._weights_checksum,
            controls.GET_WEIGHTS_BY_NAME: self._get_weights_by_name,
            controls.RESET_WEIGHTS: self._reset_weights,
        }

    def weight_updates(self) -> dict[str, Handler]:
        updates: dict[str, Handler] = {
            "update_weights_from_disk": self._update_weights_from_disk,
            "init_weights_update_group": self._init_weights_update_group,
            "update_weights_from_distributed": self._update_weights_from_distributed,
            "update_weights_from_tensor": self._update_weights_from_tensor,
            "destroy_weights_update_group": self._destroy_weights_update_group,
            "update_weight_version": self._update_weight_version,
            "set_weight_version": self._set_weight_version,
            "receive_lora_adapter": self._receive_lora_adapter,
        }
        if nixl_installed():
            updates["update_weights_from_nixl"] = self._update_weights_from_nixl
        return updates

    def _awake_model(self, doing: str) -> Any:
        if self.model is None or "weights" in self._sleeping:
            raise ControlRejected(f"the weights are asleep: call wake_up before {doing} them")
        return self.model

    def _pushable_model(self, update: str) -> Any:
        """The live model, if ``update`` may write into it now."""
        if not self._require_scheduler().paused:
            raise ControlRejected(
                f"{update} needs paused generation: call pause_generation first, then "
                "resume_generation after the update"
            )
        return self._awake_model("updating")

    async def _update_weights_from_disk(self, body: Body) -> Body:
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ControlRejected("missing non-empty `model_path` string", field="model_path")
        version = _optional_version(body)
        self._pushable_model("update_weights_from_disk")
        source = Path(model_path)
        try:
            await asyncio.to_thread(self._load_weights, source)
        except CheckpointError as exc:
            raise ControlRejected(
                f"weight update failed, the previous weights keep serving: {exc}"
            ) from exc
        await self._weights_changed()
        self._weights_source = source
        if version is not None:
            self.weight_version = version
        summed = await asyncio.to_thread(checksum_control, self.model, {})
        return {
            "status": "ok",
            "checksum": summed["checksum"],
            "message": f"Weights updated from {source}",
            "version": self.weight_version,
            "version_declared": version is not None,
        }

    def _load_weights(self, source: Path) -> None:
        scheduler = self._require_scheduler()
        plan = plan_weight_update(self.model, read_safetensors(source))
        with scheduler.step_lock:
            apply_weight_update(plan)

    async def _weights_changed(self) -> None:
        # Cached prefixes hold KV the old weights computed.
        await asyncio.to_thread(self._require_scheduler().reset_prefix_cache)
        # Cached image features came from the old vision tower.
        if self.vision is not None:
            self.vision.forget()
        if self.int8_weights or self.gguf_weights:
            await asyncio.to_thread(self._requantize)

    def _requantize(self) -> None:
        with self._require_scheduler().step_lock:
            requantize(self.model)

    async def _push(self, update: str, body: Body, run: Callable[[Any], Body]) -> Body:
        version = _optional_version(body)
        model = self._pushable_model(update)
        try:
            result = await asyncio.to_thread(run, model)
        except WeightSyncError as exc:
            raise ControlRejected(
                f"{update} refused, the previous weights keep serving: {exc}"
            ) from exc
        await self._weights_changed()
        if version is not None:
            self.weight_version = version
        return {**result, "weight_version": self.weight_version}

    async def _init_weights_update_group(self, body: Body) -> Body:
        device, _ = self._placement()
        try:
            return await asyncio.to_thread(self.weight_sync.init_group, body, device)
        except WeightSyncError as exc:
            raise ControlRejected(str(exc)) from exc

    async def _destroy_weights_update_group(self, body: Body) -> Body:
        try:
            return self.weight_sync.destroy_group(body)
        except WeightSyncError as exc:
            raise ControlRejected(str(exc)) from exc

    async def _update_weights_from_distributed(self, body: Body) -> Body:
        device, _ = self._placement()
        lock = self._require_scheduler().step_lock
        return await self._push(
            "update_weights_from_distributed",
            body,
            lambda model: self.weight_sync.receive(model, body, device, lock),
        )

    async def _update_weights_from_tensor(self, body: Body) -> Body:
        trusted = body.get("trust_weight_payloads") is True
        lock = self._require_scheduler().step_lock
        return await self._push(
            "update_weights_from_tensor",
            body,
            lambda model: self.weight_sync.load_tensors(model, body, trusted=trusted, lock=lock),
        )

    async def _update_weights_from_nixl(self, body: Body) -> Body:
        lock = self._require_scheduler().step_lock
        return await self._push(
            "update_weights_from_nixl",
            body,
            lambda model: self.weight_sync.pull_nixl(model, body, lock=lock),
        )

    async def _receive_lora_adapter(self, body: Body) -> Body:
        """``{group_name, names, dtypes, shapes, lora_config: {r, lora_alpha,
        target_modules, bias}, adapter_dir}``: the broadcast adapter, written into
        ``adapter_dir`` once every tensor has arrived (generation keeps running)."""
        folder = body.get("adapter_dir")
        if not isinstance(folder, str) or not folder:
            raise ControlRejected("missing non-empty `adapter_dir` string", field="adapter_dir")
        fields = body.get("lora_config")
        if not isinstance(fields, dict):
            raise ControlRejected("`lora_config` must be an object", field="lora_config")
        device, _ = self._placement()
        configs: list[Any] = []

        def check(specs: list[TensorSpec]) -> None:
            keys = [lora_file_key(spec.name) for spec in specs]
            if len(set(keys)) != len(keys):
                raise LoraError("'names' name one LoRA matrix twice")
            configs.append(lora_config(fields))

        def receive() -> int:
            tensors = self.weight_sync.receive_adapter(body, device, check)
            save_adapter(Path(folder), configs[0], tensors)
            return len(tensors)

        try:
            received = await asyncio.to_thread(receive)
        except (WeightSyncError, LoraError) as exc:
            raise ControlRejected(f"receive_lora_adapter refused: {exc}") from exc
        return {
            "status": "ok",
            "success": True,
            "message": f"received {received} LoRA tensors into {folder}",
            "tensors": received,
        }

    async def _read_weights(self, doing: str, field: str, read: Callable[[Any], Body]) -> Body:
        """``read(model)`` off the loop; a refusal names ``field``."""
        model = self._awake_model(doing)
        try:
            return await asyncio.to_thread(read, model)
        except WeightSyncError as exc:
            raise ControlRejected(str(exc), field=field) from exc

    async def _weights_checksum(self, body: Body) -> Body:
        return await self._read_weights(
            "checking", "names", lambda model: checksum_control(model, body)
        )

    async def _get_weights_by_name(self, body: Body) -> Body:
        wanted = controls.parse_weights_by_name(body)
        return await self._read_weights(
            "reading", "name", lambda model: weights_by_name(model, wanted)
        )

    async def _reset_weights(self, body: Body) -> Body:
        model = self._awake_model("resetting")
        lock = self._require_scheduler().step_lock

        def reset() -> Body:
            with lock:
                randomize_weights(model)
            return checksum_control(model, {})

        summed = await asyncio.to_thread(reset)
        await self._weights_changed()
        return {"status": "ok", "checksum": summed["checksum"]}

    async def weights_snapshot(self) -> Snapshot:
        """A CPU copy of every tensor with the version and source: what
        :meth:`restore_weights_snapshot` puts back (a Ray fleet's rollback of an update
        another replica failed). It costs the model's size in host memory while held."""
        if self.model is None or "weights" in self._sleeping:
            raise RuntimeError("the weights are asleep: call wake_up before updating them")
        model, lock = self.model, self._require_scheduler().step_lock

        def copy() -> dict[str, torch.Tensor]:
            with lock:
                return {
                    name: tensor.detach().to("cpu", copy=True)
                    for name, tensor in model.state_dict().items()
                }

        return await asyncio.to_thread(copy), self.weight_version, self._weights_source

    async def restore_weights_snapshot(self, snapshot: Snapshot) -> None:
        saved, version, source = snapshot
        model, lock = self.model, self._require_scheduler().step_lock

        def put_back() -> None:
            live = model.state_dict()
            with lock, torch.no_grad():
                for name, tensor in saved.items():
                    live[name].copy_(tensor)

        await asyncio.to_thread(put_back)
        await self._weights_changed()
        self.weight_version, self._weights_source = version, source

    async def _get_weight_version(self, body: Body) -> Body:
        version = self.weight_version
        return {
            "status": "ok",
            "version": version,
            "version_declared": version is not None,
            "weight_version": version,
        }

    async def _update_weight_version(self, body: Body) -> Body:
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise ControlRejected("missing non-empty `new_version` string", field="new_version")
        self.weight_version = version
        return {"status": "ok", "success": True, "new_version": version}

    async def _set_weight_version(self, body: Body) -> Body:
        version = body.get("weight_version")
        if not isinstance(version, str) or not version:
            raise ControlRejected("Missing 'weight_version' in body", field="weight_version")
        self.weight_version = version
        return {"status": "ok", "version": version}
