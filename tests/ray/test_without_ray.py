"""``penstock serve --ray`` where Ray is not installed: one line naming the extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.server import REPO_ROOT, free_port


def test_serve_ray_without_ray_names_the_extra(tmp_path: Path) -> None:
    # A ``ray`` package that fails to import stands in for a missing one.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "penstock", "serve", "--ray", "--port", str(free_port())],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("penstock:")]
    assert len(errors) == 1
    assert "pip install 'penstock[ray]'" in errors[0]
