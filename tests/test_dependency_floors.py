"""The environment the suite runs in satisfies the ranges ``pyproject.toml`` declares.

A floor the suite never runs against can be false for years; this at least catches a
declared range that excludes what is installed (and so what was tested)."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def runtime_requirements() -> list[Requirement]:
    with PYPROJECT.open("rb") as file:
        return [Requirement(line) for line in tomllib.load(file)["project"]["dependencies"]]


def test_installed_runtime_dependencies_satisfy_their_declared_ranges() -> None:
    checked, outside = [], []
    for requirement in runtime_requirements():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            continue
        checked.append(requirement.name)
        if not requirement.specifier.contains(installed, prereleases=True):
            outside.append(f"{requirement.name} {installed} (declared {requirement})")
    assert checked, "none of the declared dependencies is installed"
    assert outside == [], "installed outside the declared range: " + "; ".join(outside)
