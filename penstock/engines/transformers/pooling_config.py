"""How a checkpoint pools its hidden states into one embedding.

The choice, in order: the operator's ``--pooling``; the checkpoint's sentence-transformers
configuration (``modules.json`` naming a ``Pooling`` module, whose ``config.json`` sets one
``pooling_mode_*``); else what vLLM does by default: the last token for a decoder
(``*ForCausalLM``) checkpoint, the first (``[CLS]``) token for an encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from penstock.engines.transformers.weights.checkpoint import CheckpointError

Pooling = Literal["cls", "mean", "last", "max"]
POOLINGS: tuple[Pooling, ...] = ("cls", "mean", "last", "max")

_SENTENCE_TRANSFORMERS_MODES: dict[str, Pooling] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
}
_POOLING_MODULE = "sentence_transformers.models.Pooling"
# Modules that only pass the pooled vector through or normalise it (every embedding here
# is normalised); any other module after pooling would change the vector.
_NEUTRAL_MODULES = {
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Normalize",
}


def choose_pooling(folder: Path, config: Any, asked: str) -> Pooling:
    """The pooling of the checkpoint in ``folder`` (see the module docstring)."""
    if asked != "auto":
        return asked  # type: ignore[return-value]
    configured = sentence_transformers_pooling(folder)
    if configured is not None:
        return configured
    architectures = getattr(config, "architectures", None) or []
    if any(name.endswith("ForCausalLM") for name in architectures):
        return "last"
    return "cls"


def sentence_transformers_pooling(folder: Path) -> Pooling | None:
    """The pooling ``modules.json`` configures, None without one; a configuration this
    engine cannot reproduce is refused rather than served differently."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise CheckpointError(f"{modules_file} is not a list of modules")
    pooling: Pooling | None = None
    for module in modules:
        kind = module.get("type") if isinstance(module, dict) else None
        if kind == _POOLING_MODULE:
            pooling = _pooling_mode(folder / str(module.get("path", "")) / "config.json")
        elif kind not in _NEUTRAL_MODULES:
            raise CheckpointError(
                f"{modules_file} has a module of type {kind!r}, which this engine does not "
                "apply; serve the checkpoint without it or choose --pooling"
            )
    return pooling


def _pooling_mode(config_file: Path) -> Pooling:
    settings = _read_json(config_file)
    if not isinstance(settings, dict):
        raise CheckpointError(f"{config_file} is not an object")
    chosen = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value]
    if len(chosen) != 1 or chosen[0] not in _SENTENCE_TRANSFORMERS_MODES:
        supported = ", ".join(_SENTENCE_TRANSFORMERS_MODES)
        raise CheckpointError(
            f"{config_file} sets {chosen or 'no pooling mode'}; this engine pools with "
            f"exactly one of {supported}"
        )
    return _SENTENCE_TRANSFORMERS_MODES[chosen[0]]


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
