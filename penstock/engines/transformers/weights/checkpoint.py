"""Loading a causal-LM checkpoint, and replacing the weights of a live model from disk.

A weight update is all-or-nothing: the new tensors are read and checked against the live
model (every name known, every shape equal, every parameter covered) before the first
live tensor is written, so a bad checkpoint leaves the old weights serving unchanged.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# "org/name" as the Hugging Face hub spells repository ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not fit the live model."""


def _looks_like_hub_id(path: Path) -> bool:
    return not path.is_absolute() and _HUB_ID.fullmatch(str(path)) is not None


def check_checkpoint_folder(path: Path) -> Path:
    """The resolved folder of a loadable checkpoint, or a ``CheckpointError`` saying why not."""
    if not path.exists():
        if _looks_like_hub_id(path):
            # Users coming from vLLM expect a hub id to be downloaded; say how to get the
            # folder instead of leaving them to guess why "not found".
            raise CheckpointError(
                f"model checkpoint not found: {path} is not a local folder, and only local "
                f"folders are loaded (nothing is downloaded); if it is a Hugging Face hub id, "
                f"download it with 'hf download {path} --local-dir DIR' and pass --model DIR"
            )
        raise CheckpointError(f"model checkpoint not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"model checkpoint must be a folder, got a file: {path}")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"model checkpoint {path} has no config.json")
    if not any(next(path.glob(pattern), None) for pattern in _WEIGHT_PATTERNS):
        raise CheckpointError(f"model checkpoint {path} has no *.safetensors or *.bin weights")
    if not os.access(path / "config.json", os.R_OK):
        raise CheckpointError(f"model checkpoint {path} is not readable")
    return path.resolve()


def load_model(path: Path, *, dtype: torch.dtype, device: torch.device) -> Any:
    """Load a causal LM for inference; failures become a ``CheckpointError``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load the model checkpoint at {path}: {exc}") from exc
    return model.to(device).eval()


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is not a .safetensors file")
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
        raise CheckpointError(f"no .safetensors files in {path}")
    raise CheckpointError(f"weights path not found: {path}")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file or folder, on the CPU."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return tensors


def _describe(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the names its checkpoint uses.

    A LoRA layer injected by peft holds the original layer as ``base_layer`` next to the
    adapters' own tensors; a base checkpoint names only the original tensors.
    """
    live = model.state_dict()
    if not any(".base_layer." in name for name in live):
        return live
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuners = [
        name + "." for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)
    ]
    named: dict[str, torch.Tensor] = {}
    for name, tensor in live.items():
        prefix = next((p for p in tuners if name.startswith(p)), None)
        if prefix is None:
            named[name] = tensor
        elif name.startswith(prefix + "base_layer."):
            named[prefix + name.removeprefix(prefix + "base_layer.")] = tensor
    return named


def plan_weight_update(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair each live tensor with its replacement, or raise ``CheckpointError``."""
    live = checkpoint_state_dict(model)
    tensors = _named_as_loaded(model, tensors, live)
    unknown = sorted(set(tensors) - set(live))
    if unknown:
        raise CheckpointError(f"checkpoint tensors not in the model: {_describe(unknown)}")
    mismatched = [
        f"{name} {tuple(tensors[name].shape)} != {tuple(live[name].shape)}"
        for name in sorted(tensors)
        if tensors[name].shape != live[name].shape
    ]
    if mismatched:
        raise CheckpointError(f"checkpoint shapes do not match the model: {_describe(mismatched)}")
    # Tied parameters (e.g. lm_head and embeddings) appear once in a checkpoint.
    provided = {live[name].data_ptr() for name in tensors}
    missing = sorted(
        name for name in live if name not in tensors and live[name].data_ptr() not in provided
    )
    if missing:
        raise CheckpointError(f"checkpoint lacks model tensors: {_describe(missing)}")
    plan = []
    for name, new in tensors.items():
        if not torch.isfinite(new.float()).all():
            raise CheckpointError(f"checkpoint tensor {name} holds NaN or infinite values")
        target = live[name]
        plan.append((target, new.to(dtype=target.dtype, device=target.device)))
    return plan


def _named_as_loaded(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], live: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names the loaded model uses.

    Some architectures are saved under older names than they load with (a LLaVA folder
    says ``language_model.model.*``, the model ``model.language_model.*``); transformers
    renames them while loading, and an update from the same folder must do the same.
    """
    if set(tensors) <= set(live):
        return tensors
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:
        return tensors
    renamings = [
        transform
        for transform in get_model_conversion_mapping(model)
        if isinstance(transform, WeightRenaming)
    ]
    if not renamings:
        return tensors
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        target = name
        if name not in live:
            target, _ = rename_source_key(name, renamings, [], prefix, live)
        renamed[target] = tensor
    return renamed


def apply_weight_update(plan: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for target, new in plan:
            target.copy_(new)
