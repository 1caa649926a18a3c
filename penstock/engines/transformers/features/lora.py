"""LoRA adapters on a live causal LM, through peft.

Every adapter is injected into the one base model (peft's ``PeftModel``), so rows of one
batch can each use a different adapter or none: the forward pass gets one adapter name per
row (``adapter_names``), and peft applies each adapter only to its rows. With no adapter
loaded the base model runs unwrapped, exactly as before the first load.

An adapter is read once into memory (its config and tensors, on the CPU); that copy is
what gets injected, so it is re-attached from memory when the base model is rebuilt after
a level-2 sleep, without reading its folder again.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from penstock.engines.weights.sync import lora_file_key
from penstock.extras import LORA_INSTALL

# peft's placeholder name for "no adapter" in ``adapter_names``.
BASE_ROW = "__base__"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class LoraError(ValueError):
    """An adapter folder that can't be loaded, or a name that can't be used."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter read from disk: ``key`` is its name inside peft (request names may hold
    characters a module name can't)."""

    name: str
    key: str
    path: Path
    config: Any
    tensors: dict[str, torch.Tensor]


def _require_peft() -> None:
    """``LoraError`` naming the extra where peft, which only LoRA needs, is not installed."""
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        raise LoraError(f"LoRA adapters need peft, which is not installed: {LORA_INSTALL}") from exc


def _weights_file(folder: Path) -> Path:
    for name in ADAPTER_WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise LoraError(f"LoRA folder {folder} has no {' or '.join(ADAPTER_WEIGHT_FILES)}")


def read_adapter(name: str, key: str, folder: Path) -> LoraAdapter:
    """Read a folder written by peft's ``save_pretrained``; ``LoraError`` says what is wrong."""
    _require_peft()
    from peft import LoraConfig, PeftConfig, load_peft_weights

    if not folder.exists():
        raise LoraError(f"LoRA folder not found: {folder}")
    if not folder.is_dir():
        raise LoraError(f"LoRA path must be a folder, got a file: {folder}")
    if not (folder / ADAPTER_CONFIG_FILE).is_file():
        raise LoraError(f"LoRA folder {folder} has no {ADAPTER_CONFIG_FILE}")
    _weights_file(folder)
    try:
        config = PeftConfig.from_pretrained(str(folder))
    except Exception as exc:
        raise LoraError(f"cannot read {folder / ADAPTER_CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, LoraConfig):
        kind = getattr(config, "peft_type", type(config).__name__)
        raise LoraError(f"{folder} holds a {kind} adapter; only LoRA adapters are supported")
    # peft mixes adapters in one batch only for plain LoRA (no DoRA, no activated LoRA).
    if config.use_dora:
        raise LoraError(f"{folder} is a DoRA adapter; only plain LoRA adapters are supported")
    if getattr(config, "alora_invocation_tokens", None):
        raise LoraError(f"{folder} is an activated LoRA; only plain LoRA adapters are supported")
    try:
        tensors = load_peft_weights(str(folder), device="cpu")
    except Exception as exc:
        raise LoraError(f"cannot read the LoRA weights in {folder}: {exc}") from exc
    config.inference_mode = True
    return LoraAdapter(name, key, folder, config, tensors)


def lora_config(fields: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` from a trainer's ``{r, lora_alpha, target_modules, bias}``."""
    _require_peft()
    from peft import LoraConfig

    try:
        return LoraConfig(
            r=fields["r"],
            lora_alpha=fields["lora_alpha"],
            target_modules=fields["target_modules"],
            bias=fields.get("bias", "none"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise LoraError(f"'lora_config' is not a LoRA configuration: {exc}") from exc


def save_adapter(folder: Path, config: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` (named as :func:`~penstock.engines.weights.sync.lora_file_key`
    reads them) and ``config`` as
    peft's ``save_pretrained`` does, so the folder loads as any other adapter."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    named = {lora_file_key(name): tensor.contiguous() for name, tensor in tensors.items()}
    save_file(named, str(folder / ADAPTER_WEIGHT_FILES[0]))


class AdapterSet:
    """The adapters attached to one base model, and the module a forward pass calls."""

    def __init__(self) -> None:
        self.adapters: dict[str, LoraAdapter] = {}
        self._peft_model: Any = None
        self._keys = itertools.count(1)

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def __bool__(self) -> bool:
        return bool(self.adapters)

    def next_key(self) -> str:
        return f"lora{next(self._keys)}"

    def forward_module(self, base_model: Any) -> Any:
        """What the scheduler calls: the peft wrapper while adapters are loaded."""
        return self._peft_model if self.adapters else base_model

    def attach(self, base_model: Any, adapter: LoraAdapter) -> None:
        """Inject ``adapter``; on failure the model is left as it was."""
        self._inject(base_model, adapter)
        self.adapters[adapter.name] = adapter

    def detach(self, name: str) -> None:
        """Remove an adapter; the last one out restores the unwrapped base modules."""
        adapter = self.adapters.pop(name)
        if self._peft_model is None:
            return
        if self.adapters:
            self._peft_model.delete_adapter(adapter.key)
        else:
            self._peft_model.unload()
            self._peft_model = None

    def reattach(self, base_model: Any) -> None:
        """Inject every adapter into a freshly loaded base model."""
        self._peft_model = None
        for adapter in self.adapters.values():
            self._inject(base_model, adapter)

    def forget_model(self) -> None:
        """The base model was dropped (level-2 sleep); keep the adapters for ``reattach``."""
        self._peft_model = None

    def _inject(self, base_model: Any, adapter: LoraAdapter) -> None:
        from peft import PeftModel, set_peft_model_state_dict

        config = copy.deepcopy(adapter.config)
        created = self._peft_model is None
        try:
            if created:
                # Adapters compute in the base model's dtype, not upcast (peft's default,
                # meant for training).
                peft_model = PeftModel(
                    base_model, config, adapter_name=adapter.key, autocast_adapter_dtype=False
                ).eval()
            else:
                peft_model = self._peft_model
                peft_model.add_adapter(adapter.key, config, autocast_adapter_dtype=False)
        except Exception as exc:
            raise LoraError(f"LoRA adapter {adapter.path} does not fit the model: {exc}") from exc
        try:
            result = set_peft_model_state_dict(
                peft_model, adapter.tensors, adapter_name=adapter.key
            )
            # The adapter's own tensors that the injected layers expect but the file lacks.
            missing = [k for k in result.missing_keys if ".lora_" in k and f".{adapter.key}." in k]
            if result.unexpected_keys:
                raise LoraError(
                    f"LoRA adapter {adapter.path} has tensors for modules the model lacks: "
                    f"{_describe(result.unexpected_keys)}"
                )
            if missing:
                raise LoraError(f"LoRA adapter {adapter.path} lacks tensors: {_describe(missing)}")
        except Exception as exc:
            if created:
                peft_model.unload()
            else:
                peft_model.delete_adapter(adapter.key)
            if isinstance(exc, LoraError):
                raise
            # torch reports shape mismatches as "size mismatch for <name>: ...".
            raise LoraError(f"LoRA adapter {adapter.path} does not fit the model: {exc}") from exc
        self._peft_model = peft_model


def _describe(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
