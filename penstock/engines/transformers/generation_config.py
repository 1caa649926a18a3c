"""Default sampling parameters from a model's ``generation_config.json``, as vLLM's
``--generation-config`` does: the model's authors know which temperature, nucleus and
length suit it, and a request that sets none of them should get those rather than
unbounded sampling at temperature 1.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from penstock.engines.transformers.core.sampling import SamplingDefaults

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
AUTO = "auto"
NEUTRAL = "vllm"
_FIX = f"fix it, or start with --generation-config {NEUTRAL} to ignore it"


class GenerationConfigError(ValueError):
    """A generation config can't supply defaults; the message names the file and the fix."""


def _read(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationConfigError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise GenerationConfigError(f"{path} is not valid JSON ({exc}); {_FIX}") from exc
    if not isinstance(values, dict):
        raise GenerationConfigError(f"{path} must hold a JSON object; {_FIX}")
    return values


def load_sampling_defaults(choice: str, model_path: Path) -> SamplingDefaults:
    """The defaults ``--generation-config`` ``choice`` selects for the model in ``model_path``.

    ``auto`` reads the model folder's file and is neutral when there is none; a PATH must
    hold the file, since naming a folder without one is a mistake worth stopping for.
    """
    if choice == NEUTRAL:
        return SamplingDefaults()
    if choice == AUTO:
        path = model_path / GENERATION_CONFIG_FILE
        if not path.is_file():
            return SamplingDefaults()
    else:
        path = Path(choice).expanduser() / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise GenerationConfigError(
                f"--generation-config {choice}: no {GENERATION_CONFIG_FILE} in that folder "
                f"(expected {AUTO}, {NEUTRAL}, or a folder containing {GENERATION_CONFIG_FILE})"
            )
    values = _read(path)
    try:
        defaults = SamplingDefaults.from_generation_config(values)
    except ValueError as exc:
        raise GenerationConfigError(f"{path}: {exc}; {_FIX}") from exc
    changed = {
        name: value
        for name, value in asdict(defaults).items()
        if value != getattr(SamplingDefaults(), name)
    }
    if changed:
        listed = ", ".join(f"{name}={value}" for name, value in changed.items())
        logger.info(
            "requests that leave them out get %s from %s (--generation-config %s ignores it)",
            listed,
            path,
            NEUTRAL,
        )
    return defaults
