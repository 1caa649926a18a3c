"""What ``penstock serve`` settles before the engine loads: a Hugging Face hub id taken
from the local hub cache, and API key variables that are set but not read."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from penstock.engines.engine_options import BuiltinEngine
from penstock.options import DeclaredOption, declared_options
from penstock.settings import Settings

logger = logging.getLogger("penstock")

# ``org/name`` as the hub spells repositories.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Variables an operator may set believing they protect this server.
_KEY_VARIABLE = re.compile(r"^(PENSTOCK|VLLM|SGLANG)_\w*API_KEYS?$")
_KEY_FIELDS = ("api_keys", "admin_api_keys")


class HubModelNotCached(Exception):
    """``--model`` names a hub repository that is not in the local hub cache."""


def resolve_hub_model(settings: Settings, engine: BuiltinEngine | None) -> Settings:
    """``settings`` with a ``--model`` hub id replaced by its snapshot folder in the local
    Hugging Face cache (and served under the hub id unless ``--served-model-name`` says
    otherwise), for engines that load checkpoint folders. Nothing is downloaded."""
    model = settings.model
    if (
        engine is None
        or not engine.loads_checkpoint
        or not model
        or not _HUB_ID.match(model)
        or Path(model).expanduser().exists()
    ):
        return settings
    from penstock.lora.sources import hf_hub_cache_dir

    folder = _cached_snapshot(model, hf_hub_cache_dir())
    if folder is None:
        raise HubModelNotCached(
            f"--model {model}: not a local folder, and not in the local Hugging Face cache "
            f"({hf_hub_cache_dir()}); nothing is downloaded here: fetch it first with "
            f"'hf download {model}'"
        )
    logger.info("serving %s from the local Hugging Face cache: %s", model, folder)
    update: dict[str, Any] = {"model": str(folder)}
    if settings.served_model_name is None:
        # The engine is told the name too, so the snapshot's path is no second name.
        update["served_model_name"] = model
        if engine.option("--served-model-name") is not None:
            update["engine_args"] = ["--served-model-name", model, *settings.engine_args]
    return settings.model_copy(update=update)


def _cached_snapshot(repo_id: str, cache_dir: Path) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        return None
    return Path(str(folder))


def unused_key_variables(
    settings: Settings, given: set[str], environ: Mapping[str, str]
) -> list[str]:
    """One warning per API key variable that is set but that no key is read from: a name
    Penstock does not read (``PENSTOCK_API_KEY``), or vLLM's ``VLLM_API_KEY`` when
    ``--api-key`` or ``PENSTOCK_API_KEYS`` (``given``: the settings on the command line)
    gives the keys instead."""
    readers: dict[str, DeclaredOption] = {}
    for declared in declared_options(Settings):
        if declared.field in _KEY_FIELDS:
            readers[declared.env_var] = declared
            if declared.option.also_env is not None:
                readers[declared.option.also_env] = declared
    warnings = []
    for name in sorted(environ):
        if not _KEY_VARIABLE.match(name) or not environ[name].strip():
            continue
        declared = readers.get(name)
        if declared is None:
            sources = "; ".join(_sources(reader) for reader in dict.fromkeys(readers.values()))
            state = "" if settings.api_keys else "; the inference routes are open"
            warnings.append(f"{name} is set but not read (keys come from {sources}){state}")
        elif name == declared.option.also_env:
            warnings += _outranked(name, declared, given, environ)
    return warnings


def _outranked(
    name: str, declared: DeclaredOption, given: set[str], environ: Mapping[str, str]
) -> list[str]:
    if declared.field in given:
        return [f"{name} is set but not used: {declared.flag} gives the keys"]
    if environ.get(declared.env_var, "").strip():
        return [f"{name} is set but not used: {declared.env_var} gives the keys"]
    return []


def _sources(declared: DeclaredOption) -> str:
    names = [str(declared.flag), declared.env_var]
    if declared.option.also_env is not None:
        names.append(declared.option.also_env)
    return ", ".join(names)
