"""The engine contract, ``serving/`` and ``rl/`` type-check under mypy's strict mode (the
package ships ``py.typed``, so engine authors and trainers see these annotations). What is
checked and how is ``[tool.mypy]`` in ``pyproject.toml``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support.server import REPO_ROOT


def test_the_typed_modules_have_no_type_errors() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed; it comes with the dev extra: pip install -e '.[dev]'")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Success: no issues found" in checked.stdout
