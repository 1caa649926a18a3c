"""Run a Python snippet in a fresh interpreter, from the repository root: for what a
process imports or does at startup, which the test process itself has already changed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.server import REPO_ROOT


def run_snippet(code: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``code`` (dedented) run by ``python -c``; its output is captured as text."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        timeout=timeout_s,
    )
