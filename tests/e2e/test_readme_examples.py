"""The README's examples, executed as written against ``penstock serve`` on the default model.

The two setup commands at the top are checked too: the test command is exactly what CI
runs, and the serve command ends in the ``penstock serve`` this test starts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.server import REPO_ROOT, ServerProcess, running_server

README = REPO_ROOT / "README.md"
CODE_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
DOCUMENTED_ADDRESS = "127.0.0.1:8000"
# The first start may convert the default model (about a minute; more on a busy machine).
READY_TIMEOUT_S = 600.0
EXAMPLE_TIMEOUT_S = 300.0


def code_blocks(text: str) -> list[tuple[str, str]]:
    return [(match[1], match[2]) for match in CODE_BLOCK.finditer(text)]


def usage_examples() -> list[tuple[str, str]]:
    """The blocks of the "Using it" section, up to its first subsection."""
    text = README.read_text()
    start = text.index("## Using it")
    end = text.index("\n### ", start)
    return code_blocks(text[start:end])


def test_the_setup_commands_are_the_ones_ci_and_this_test_run() -> None:
    (serve_language, serve), (test_language, tests) = code_blocks(README.read_text())[:2]
    assert (serve_language, test_language) == ("bash", "bash")
    assert serve.strip().endswith("&& .venv/bin/penstock serve")
    ci_commands = [
        line
        for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci_commands == [tests.strip()]


def test_the_usage_section_has_curl_python_and_admin_examples() -> None:
    examples = usage_examples()
    languages = [language for language, _ in examples]
    assert "python" in languages and "bash" in languages
    every_line = "\n".join(code for _, code in examples)
    for route in ("/v1/chat/completions", "pause_generation", "resume_generation", "/metrics"):
        assert route in every_line


@pytest.fixture(scope="module")
def default_model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("readme")
    with running_server([], log_dir, ready_timeout=READY_TIMEOUT_S) as server:
        yield server


def run_example(language: str, code: str, server: ServerProcess) -> subprocess.CompletedProcess:
    code = code.replace(DOCUMENTED_ADDRESS, f"127.0.0.1:{server.port}")
    command = (
        [sys.executable, "-c", code]
        if language == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    return subprocess.run(
        command, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S, cwd=REPO_ROOT
    )


def json_objects(output: str) -> list[dict]:
    """Each curl call prints one JSON object; they follow each other without separators."""
    decoder = json.JSONDecoder()
    objects, position = [], 0
    text = output.strip()
    while position < len(text):
        value, position = decoder.raw_decode(text, position)
        objects.append(value)
        while position < len(text) and text[position].isspace():
            position += 1
    return objects


@pytest.mark.slow
@pytest.mark.parametrize("position", range(len(usage_examples())))
def test_usage_example_runs_as_written(position: int, default_model_server: ServerProcess) -> None:
    language, code = usage_examples()[position]
    result = run_example(language, code, default_model_server)
    assert result.returncode == 0, f"{code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.strip(), f"{code} printed nothing"
    if language == "bash" and "curl -s http" in code and "/metrics" in code:
        assert all(line.startswith("penstock_") for line in result.stdout.splitlines())
    elif language == "bash":
        for answer in json_objects(result.stdout):
            assert "error" not in answer, f"{code}\n{answer}"
            assert answer.get("status") in (None, "ok")
