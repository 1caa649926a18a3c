"""Penstock's dependencies at the lowest versions ``pyproject.toml`` admits, as pip
requirements, and a venv that holds them (see ``tests/test_lower_bounds.py``).

    python -m tests.support.lower_bounds VENV   # build VENV, print its requirements

Every runtime requirement and those of the ``video``, ``lora`` and ``s3`` extras with a
lower bound is pinned to it (``name==lower``), extras and markers kept. torch is the
exception: its lower end is a multi-GB CUDA download, so 2.13.0, the CPU build the README
installs, is tested at both ends. xgrammar goes in at its lower bound with ``--no-deps``,
as the README installs it. The test tooling (pytest and what the tests import) is taken
at any version.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("video", "lora", "s3")
TORCH = "torch==2.13.0"
# What the tests of the lower-bound run import beyond Penstock's own dependencies.
TEST_TOOLS = (
    "pytest>=8",
    "pytest-asyncio>=0.24",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    "jsonschema>=4.22",
    "pyyaml>=6",
)


def _project() -> dict[str, object]:
    with (REPO / "pyproject.toml").open("rb") as file:
        project: dict[str, object] = tomllib.load(file)["project"]
    return project


def lowest(requirement: Requirement) -> Requirement:
    """``requirement`` pinned to its lower bound (``>=`` or ``~=``), or as it is."""
    floors = [spec.version for spec in requirement.specifier if spec.operator in (">=", "~=")]
    if not floors:
        return requirement
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    marker = f"; {requirement.marker}" if requirement.marker else ""
    return Requirement(f"{requirement.name}{extras}=={floors[0]}{marker}")


def lower_bound_requirements() -> list[str]:
    """The runtime requirements and those of :data:`EXTRAS`, at their lower bounds."""
    project = _project()
    optional: dict[str, list[str]] = project["optional-dependencies"]  # type: ignore[assignment]
    lines = [*project["dependencies"], *(line for extra in EXTRAS for line in optional[extra])]  # type: ignore[misc]
    pinned = [TORCH]
    for line in lines:
        requirement = Requirement(line)
        if requirement.name != "torch":
            pinned.append(str(lowest(requirement)))
    return pinned


def xgrammar_lowest() -> str:
    """The grammar extra's xgrammar, at its lower bound."""
    optional: dict[str, list[str]] = _project()["optional-dependencies"]  # type: ignore[assignment]
    return str(lowest(Requirement(optional["grammar"][0])))


def fingerprint() -> str:
    """Names one set of bounds (and the Python running them): a venv built for it is reused."""
    text = "\n".join([sys.version, *lower_bound_requirements(), xgrammar_lowest(), *TEST_TOOLS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_venv(venv: Path) -> Path:
    """Create ``venv`` with the lower bounds installed; its Python."""
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-compile"]
    subprocess.run([*pip, *lower_bound_requirements(), *TEST_TOOLS], check=True)
    subprocess.run([*pip, "--no-deps", xgrammar_lowest()], check=True)
    return python


if __name__ == "__main__":
    print("\n".join([*lower_bound_requirements(), xgrammar_lowest()]))
    build_venv(Path(sys.argv[1]))
