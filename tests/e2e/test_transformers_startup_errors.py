"""``penstock serve`` on the transformers engine refuses what it can't load in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.server import REPO_ROOT, free_port

# Only to notice a hang: refusing takes the few seconds of importing torch.
EXIT_TIMEOUT_S = 120


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "penstock", "serve", "--port", str(free_port()), *args]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=EXIT_TIMEOUT_S,
        check=False,
    )


def _error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("penstock:")]


def test_a_hub_id_says_only_local_folders_load_and_how_to_get_one() -> None:
    result = _serve("--model", "HuggingFaceTB/SmolLM2-360M-Instruct")
    assert result.returncode != 0
    [line] = _error_lines(result)
    assert "not a local folder, and not in the local Hugging Face cache" in line
    assert "nothing is downloaded here" in line
    assert "hf download HuggingFaceTB/SmolLM2-360M-Instruct" in line


def test_a_malformed_generation_config_stops_startup(tmp_path: Path) -> None:
    # Startup stops before the weights are read, so the folder needs no real ones.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.2,}')
    result = _serve("--model", str(tmp_path))
    assert result.returncode != 0
    [line] = _error_lines(result)
    assert f"{tmp_path / 'generation_config.json'} is not valid JSON" in line
    assert "--generation-config vllm" in line
