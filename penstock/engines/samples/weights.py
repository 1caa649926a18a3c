"""The sample engine's weights: one safetensors tensor, ``token_shift``, and every way an
RL trainer replaces, reads, checks or rolls it back.

``update_weights_from_disk {model_path}`` loads a ``.safetensors`` file or a folder holding
``model.safetensors`` (see :func:`write_sample_weights`); ``update_weights_from_tensor``
takes ``serialized_named_tensors`` (base64 safetensors, see
:mod:`penstock.engines.weights.sync`) or ``named_tensors`` (``{"token_shift": [n]}``);
``update_weights_from_nixl`` (when NIXL is installed) READs ``token_shift`` from the
trainer's registered memory. A missing file, a missing or extra tensor or a wrong shape is
refused and the old weights keep serving; every update needs generation held (paused, or
asleep with the weights awake). Each answers with the checksum of what it wrote, computed
as the transformers engine computes it; ``weights_checksum`` and ``get_weights_by_name``
read the weights back, ``reset_weights`` overwrites them with a random shift. A LoRA
adapter folder (``adapter_config.json`` + ``adapter_model.safetensors`` holding
``token_shift``) adds its shift for requests whose ``model`` names it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from penstock.engines.controls import (
    GET_WEIGHTS_BY_NAME,
    RESET_WEIGHTS,
    WEIGHTS_CHECKSUM,
    Body,
    ControlRejected,
    Handler,
    parse_weights_by_name,
)
from penstock.engines.weights.sync import (
    NixlPuller,
    WeightSyncError,
    check_against,
    combine_digests,
    parse_nixl_pull,
)
from penstock.nixl_agent import nixl_installed

if TYPE_CHECKING:
    import numpy as np

    from penstock.engines.samples.controls import Hold

WEIGHTS_FILE = "model.safetensors"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
WEIGHT_SHAPES: dict[str, tuple[int, ...]] = {"token_shift": (1,)}
# ``reset_weights`` draws a shift from this range: far from the shifts tests write.
RESET_SHIFT_RANGE = (1_000, 1_000_000)


@dataclass(frozen=True)
class SampleWeights:
    """The sample engine's whole "model": how far the token rotation is shifted."""

    token_shift: int = 0
    source: str | None = None


def write_sample_weights(path: Path, token_shift: int) -> Path:
    """Write a weights file the engine loads (``path`` is a file or a folder)."""
    # NumPy only when weights are written or loaded: a served sample engine idles without.
    import numpy as np
    import safetensors.numpy

    target = path / WEIGHTS_FILE if path.is_dir() else path
    safetensors.numpy.save_file({"token_shift": np.array([token_shift], dtype=np.int64)}, target)
    return target


def check_tensors(tensors: dict[str, np.ndarray], where: str) -> int:
    """The shift ``tensors`` hold; raises ControlRejected saying what is wrong."""
    missing = sorted(set(WEIGHT_SHAPES) - set(tensors))
    if missing:
        raise ControlRejected(f"{where}: missing tensor(s) {', '.join(missing)}")
    unexpected = sorted(set(tensors) - set(WEIGHT_SHAPES))
    if unexpected:
        raise ControlRejected(f"{where}: unexpected tensor(s) {', '.join(unexpected)}")
    for name, expected in WEIGHT_SHAPES.items():
        actual = tuple(tensors[name].shape)
        if actual != expected:
            raise ControlRejected(
                f"{where}: shape mismatch for '{name}': got {list(actual)}, "
                f"the model has {list(expected)}"
            )
        if tensors[name].dtype.kind not in "iu":
            raise ControlRejected(f"{where}: '{name}' must be an integer tensor")
    return int(tensors["token_shift"][0])


def load_sample_weights(path: Path, file_name: str = WEIGHTS_FILE) -> SampleWeights:
    """Read and validate weights; raises ControlRejected (a ValueError) saying what is wrong."""
    file = path / file_name if path.is_dir() else path
    if not file.is_file():
        raise ControlRejected(f"no weights at {path}: expected a .safetensors file or {file_name}")
    import safetensors.numpy

    try:
        tensors = safetensors.numpy.load_file(file)
    except Exception as exc:
        raise ControlRejected(f"{file} is not a readable safetensors file: {exc}") from exc
    return SampleWeights(check_tensors(tensors, str(file)), str(file))


def decode_serialized(payloads: Any) -> dict[str, np.ndarray]:
    if not isinstance(payloads, list) or len(payloads) != 1 or not isinstance(payloads[0], str):
        raise ControlRejected("`serialized_named_tensors` must be a list of one base64 string")
    import safetensors.numpy

    try:
        return dict(safetensors.numpy.load(base64.b64decode(payloads[0], validate=True)))
    except Exception as exc:
        raise ControlRejected(
            f"`serialized_named_tensors` is not base64 safetensors: {exc}"
        ) from exc


def weights_checksum(weights: SampleWeights) -> tuple[str, dict[str, str]]:
    import numpy as np

    raw = np.array([weights.token_shift], dtype=np.int64).tobytes()
    digest = hashlib.sha256(raw).hexdigest()
    return combine_digests([("token_shift", "int64", (1,), digest)]), {"token_shift": digest}


def nonempty_str(body: Body, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ControlRejected(f"missing non-empty `{name}` string", field=name)
    return value


def optional_str(body: Body, name: str) -> str | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ControlRejected(f"`{name}` must be a non-empty string", field=name)
    return value


class SampleWeightControls:
    """The sample engine's weight controls and updates (mixed into the engine)."""

    weights: SampleWeights
    weight_version: str | None
    adapters: dict[str, SampleWeights]
    _holds: dict[str, Hold]
    _puller: NixlPuller | None
    # Drops what the old weights left behind (the engine's prefix cache).
    _weights_changed: Callable[[], None]

    def weight_controls(self) -> dict[str, Handler]:
        return {
            WEIGHTS_CHECKSUM: self._weights_checksum,
            GET_WEIGHTS_BY_NAME: self._get_weights_by_name,
            RESET_WEIGHTS: self._reset_weights,
        }

    def weight_updates(self) -> dict[str, Handler]:
        updates: dict[str, Handler] = {
            "update_weights_from_disk": self._update_from_disk,
            "update_weights_from_tensor": self._update_from_tensor,
            "update_weight_version": self._update_weight_version,
            "load_lora": self._load_lora,
            "unload_lora": self._unload_lora,
        }
        if nixl_installed():
            updates["update_weights_from_nixl"] = self._update_from_nixl
        return updates

    def _require_held_for_update(self) -> None:
        if "pause" not in self._holds and "sleep" not in self._holds:
            raise ControlRejected("pause generation before updating weights (pause_generation)")
        sleep = self._holds.get("sleep")
        if sleep is not None and "weights" in sleep.tags:
            raise ControlRejected("the weights are asleep: wake_up with tags ['weights'] first")

    def _install(self, weights: SampleWeights, version: str | None) -> None:
        self.weights = weights
        if version is not None:
            self.weight_version = version
        self._weights_changed()

    def _updated(self, **fields: Any) -> Body:
        return {
            "status": "ok",
            **fields,
            "weight_version": self.weight_version,
            "checksum": weights_checksum(self.weights)[0],
        }

    async def _update_from_disk(self, body: Body) -> Body:
        self._require_held_for_update()
        model_path = nonempty_str(body, "model_path")
        version = optional_str(body, "weight_version")
        weights = await asyncio.to_thread(load_sample_weights, Path(model_path))
        self._install(weights, version)
        return self._updated(model_path=model_path)

    async def _update_from_tensor(self, body: Body) -> Body:
        self._require_held_for_update()
        version = optional_str(body, "weight_version")
        import numpy as np

        if "serialized_named_tensors" in body:
            tensors = decode_serialized(body["serialized_named_tensors"])
        else:
            named = body.get("named_tensors")
            if not isinstance(named, dict):
                raise ControlRejected("`named_tensors` must be an object of name -> nested list")
            try:
                tensors = {name: np.asarray(value) for name, value in named.items()}
            except (TypeError, ValueError) as exc:
                raise ControlRejected(
                    f"`named_tensors` holds a value that is not a tensor: {exc}"
                ) from exc
        shift = check_tensors(tensors, "named_tensors")
        self._install(SampleWeights(shift, "tensor"), version)
        return self._updated()

    async def _update_from_nixl(self, body: Body) -> Body:
        self._require_held_for_update()
        version = optional_str(body, "weight_version")
        try:
            shift = await asyncio.to_thread(self._pull_shift, body)
        except WeightSyncError as exc:
            raise ControlRejected(str(exc)) from exc
        self._install(SampleWeights(shift, "nixl"), version)
        return self._updated()

    def _pull_shift(self, body: Body) -> int:
        import torch

        pull = parse_nixl_pull(body)
        live = {"token_shift": torch.tensor([self.weights.token_shift], dtype=torch.int64)}
        check_against(pull.specs, live)
        if {spec.name for spec in pull.specs} != set(WEIGHT_SHAPES):
            raise WeightSyncError("the sample model's one tensor is token_shift: send it")
        if self._puller is None:
            self._puller = NixlPuller()
        landed = torch.zeros(1, dtype=torch.int64)
        self._puller.read(pull, [0], [landed], last=True)
        return int(landed[0])

    def _refuse_if_weights_asleep(self, doing: str) -> None:
        sleep = self._holds.get("sleep")
        if sleep is not None and "weights" in sleep.tags:
            raise ControlRejected(f"the weights are asleep: call wake_up before {doing} them")

    async def _weights_checksum(self, body: Body) -> Body:
        self._refuse_if_weights_asleep("checking")
        checksum, digests = weights_checksum(self.weights)
        return {"status": "ok", "checksum": checksum, "tensors": digests}

    async def _get_weights_by_name(self, body: Body) -> Body:
        self._refuse_if_weights_asleep("reading")
        wanted = parse_weights_by_name(body)
        if wanted.name != "token_shift":
            raise ControlRejected(f"'name': {wanted.name} is not a tensor of this model")
        return {
            "status": "ok",
            "name": wanted.name,
            "dtype": "int64",
            "shape": [1],
            "values": [self.weights.token_shift][: wanted.truncate_size],
        }

    async def _reset_weights(self, body: Body) -> Body:
        self._refuse_if_weights_asleep("resetting")
        self._install(SampleWeights(random.randint(*RESET_SHIFT_RANGE), "reset"), None)
        checksum, _ = weights_checksum(self.weights)
        return {"status": "ok", "checksum": checksum}

    async def weights_snapshot(self) -> tuple[SampleWeights, str | None]:
        """What :meth:`restore_weights_snapshot` puts back: a fleet's rollback."""
        return self.weights, self.weight_version

    async def restore_weights_snapshot(self, snapshot: tuple[SampleWeights, str | None]) -> None:
        weights, version = snapshot
        self._install(weights, None)
        self.weight_version = version

    async def _update_weight_version(self, body: Body) -> Body:
        self.weight_version = nonempty_str(body, "new_version")
        return {"success": True, "new_version": self.weight_version}

    async def _load_lora(self, body: Body) -> Body:
        name = nonempty_str(body, "lora_name")
        folder = Path(nonempty_str(body, "lora_path"))
        if not (folder / ADAPTER_CONFIG_FILE).is_file():
            raise ControlRejected(f"{folder} has no {ADAPTER_CONFIG_FILE}")
        weights = await asyncio.to_thread(load_sample_weights, folder, ADAPTER_WEIGHTS_FILE)
        self.adapters[name] = weights
        return {"status": "ok", "lora_name": name}

    async def _unload_lora(self, body: Body) -> Body:
        name = nonempty_str(body, "lora_name")
        if self.adapters.pop(name, None) is None:
            raise ControlRejected(f"LoRA adapter '{name}' is not loaded")
        return {"status": "ok", "lora_name": name}
