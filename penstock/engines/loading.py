"""Find an engine class by built-in name or ``package.module:Class``."""

from __future__ import annotations

import importlib
from typing import Any

from penstock.engines.contract import model_input_of
from penstock.errors import EngineLoadError

BUILTIN_ENGINES: dict[str, str] = {
    "transformers": "penstock.engines.transformers:TransformersEngine",
    "sample": "penstock.engines.sample:SampleLLMEngine",
    "sample-diffusion": "penstock.engines.sample_diffusion:SampleDiffusionEngine",
    "diffusion": "penstock.engines.diffusion:DiffusersEngine",
}


def load_engine_class(spec: str) -> type[Any]:
    """Resolve ``spec`` to a class deriving from an engine base (``LLMEngine`` / ``RawEngine``)."""
    target = BUILTIN_ENGINES.get(spec)
    if target is None:
        if ":" not in spec:
            names = ", ".join(sorted(BUILTIN_ENGINES))
            raise EngineLoadError(
                f"unknown engine '{spec}'. Built-in engines: {names}; "
                "or give a class as package.module:Class"
            )
        target = spec
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise EngineLoadError(f"cannot import engine module '{module_name}': {exc}") from exc
    try:
        cls = getattr(module, class_name)
    except AttributeError as exc:
        raise EngineLoadError(f"module '{module_name}' has no attribute '{class_name}'") from exc
    if not isinstance(cls, type):
        raise EngineLoadError(f"'{target}' is not an engine: it is not a class")
    model_input_of(cls)
    return cls
