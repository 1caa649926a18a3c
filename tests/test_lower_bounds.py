"""Every requirement at the lowest version ``pyproject.toml`` admits still serves.

A venv holds the runtime requirements and those of the ``video``, ``lora`` and ``s3``
extras pinned to their lower bounds (:mod:`tests.support.lower_bounds` says how, and why
torch is the exception), and runs a subset of the suite against this checkout: the engine
and serving core, plus one test file per package whose floor the rest of the suite never
meets (FastAPI and Starlette, uvicorn, xgrammar, peft, s3fs, PyAV). The whole suite at both
ends would double the CI time; these files cover the code that calls each of those
packages. The venv is built once per set of bounds (a few minutes, from the package index)
and kept under ``~/.cache/penstock/lower-bounds``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.lower_bounds import REPO, build_venv, fingerprint

CACHE = Path.home() / ".cache" / "penstock" / "lower-bounds"
LOWER_BOUND_TESTS = (
    # Every generation route's handling, SSE framing, tool grammars (xgrammar).
    "tests/serving",
    # The transformers engine: generation, constrained rows (xgrammar), LoRA (peft).
    "tests/engines/transformers/test_generation.py",
    "tests/engines/transformers/test_constraints.py",
    "tests/engines/transformers/test_lora.py",
    # The app on FastAPI and Starlette, the connection code on uvicorn.
    "tests/app/test_gateway_app.py",
    "tests/app/test_uvicorn_internals.py",
    # s3:// adapters (s3fs), audio and video decoding (PyAV).
    "tests/lora",
    "tests/multimodal/test_loaders.py",
)


def lower_bound_python() -> Path:
    venv = CACHE / fingerprint()
    # Written last: a venv without it is a build that did not finish.
    complete = venv / "complete"
    if not complete.exists():
        shutil.rmtree(venv, ignore_errors=True)
        build_venv(venv)
        complete.touch()
    return venv / "bin" / "python"


@pytest.mark.timeout(1800)
def test_the_engine_and_serving_tests_pass_on_every_lower_bound() -> None:
    python = lower_bound_python()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [str(python), "-m", "pytest", *LOWER_BOUND_TESTS, "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
