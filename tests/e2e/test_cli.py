"""What ``penstock serve`` tells its operator (help, where jobs live, access log, busy port),
and the command line a vLLM user types."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import penstock
from penstock.app.cli import main
from tests.support.server import REPO_ROOT, ServerProcess, running_server

ENGINE_HEADING = "options of --engine"


def serve_help(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *args, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def option_help(section: str) -> dict[str, str]:
    """Each option of an argparse options section, with its help text."""
    entries: dict[str, str] = {}
    current: str | None = None
    for line in section.splitlines():
        if line.startswith("  -"):
            current, _, text = line.strip().partition("  ")
            entries[current] = text.strip()
        elif current is not None and line.startswith("    "):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


@pytest.fixture(autouse=True)
def wide_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("PENSTOCK_ENGINE", raising=False)


def test_every_gateway_option_has_help_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    text = serve_help(capsys, "--engine", "sample")
    gateway_section = text.split("\noptions:\n", 1)[1].split(ENGINE_HEADING, 1)[0]
    options = option_help(gateway_section)
    options.pop("-h, --help")
    for flag in ("--max-body-mb", "--max-n", "--cache-dir", "--media-workers", "--log-format"):
        assert any(name.startswith(flag + " ") for name in options), flag
    assert "--access-log, --no-access-log" in options
    missing = [name for name, help_text in options.items() if "(default:" not in help_text]
    assert missing == []
    cache_dir = next(text for name, text in options.items() if name.startswith("--cache-dir"))
    assert "<cache-dir>/models" in cache_dir and "$PENSTOCK_MODEL_CACHE" in cache_dir


def test_serve_help_lists_the_default_engines_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = serve_help(capsys)
    engine_section = text.split(f"{ENGINE_HEADING} transformers (also accepted after --):\n")[1]
    options = option_help(engine_section)
    for flag in ("--device", "--dtype", "--model-cache-dir", "--cpu-threads", "--max-model-len"):
        assert any(name.startswith(flag + " ") for name in options), flag
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in options


def test_serve_help_follows_the_chosen_engine(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = serve_help(capsys, "--engine", "sample")
    assert f"{ENGINE_HEADING} sample (also accepted after --):" in text
    assert "--delay DELAY" in text and "--max-tokens MAX_TOKENS" in text
    assert "--device" not in text
    monkeypatch.setenv("PENSTOCK_ENGINE", "sample-diffusion")
    assert f"{ENGINE_HEADING} sample-diffusion (also accepted after --):" in serve_help(capsys)


def test_serve_help_lists_a_class_engines_argparse_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = serve_help(capsys, "--engine", "tests.support.doubles:MarkedSampleEngine")
    heading = f"{ENGINE_HEADING} tests.support.doubles:MarkedSampleEngine (pass them after --):"
    assert "--marker MARKER" in text.split(heading, 1)[1]


def test_serve_help_says_how_to_ask_an_engine_without_argparse_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "tests.support.doubles:ScriptedEngine"
    engine_section = serve_help(capsys, "--engine", spec).split(ENGINE_HEADING, 1)[1]
    lines = engine_section.strip().splitlines()
    assert len(lines) == 2
    assert f"penstock serve --engine {spec} -- --help" in lines[1]


def test_cache_dir_roots_the_engines_model_cache_unless_it_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PENSTOCK_MODEL_CACHE", raising=False)
    record = tmp_path / "model-cache.txt"
    engine = "tests.support.doubles:ModelCacheRecordingEngine"
    args = ["--engine", engine, "--cache-dir", str(tmp_path / "cache"), "--", "--record"]
    with running_server([*args, str(record)], tmp_path):
        assert record.read_text() == str(tmp_path / "cache" / "models")
    chosen = str(tmp_path / "models-elsewhere")
    with running_server([*args, str(record)], tmp_path, env={"PENSTOCK_MODEL_CACHE": chosen}):
        assert record.read_text() == chosen


def video_args(cache_dir: Path, model: str) -> list[str]:
    return [
        "--engine",
        "sample-diffusion",
        "--cache-dir",
        str(cache_dir),
        "--served-model-name",
        model,
        "--",
        "--endpoint-types",
        "videos",
        "--delay",
        "0",
    ]


def listed_jobs(server: ServerProcess) -> list[str]:
    return [job["id"] for job in httpx.get(f"{server.base_url}/v1/videos").json()["data"]]


def test_servers_of_different_models_keep_their_jobs_apart(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with (
        running_server(video_args(cache, "org/first"), tmp_path) as first,
        running_server(video_args(cache, "second"), tmp_path) as second,
    ):
        created = httpx.post(
            f"{first.base_url}/v1/videos", json={"model": "org/first", "prompt": "a red ball"}
        )
        assert created.status_code == 200
        assert listed_jobs(first) == [created.json()["id"]]
        assert listed_jobs(second) == []
    store = cache / "media" / "org_first"
    assert f"video jobs kept in {store / 'jobs.sqlite3'}, generated media in {store}" in (
        first.log()
    )
    assert str(cache / "media" / "second") in second.log()


def chat(server: ServerProcess, request_id: str, **extra: object) -> httpx.Response:
    body = {"model": "sample-model", "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={**body, "max_tokens": 3, **extra},
        headers={"x-request-id": request_id},
    )


def access_lines(log: str, marker: str) -> list[str]:
    return [line for line in log.splitlines() if "penstock.access" in line and marker in line]


def test_each_request_gets_one_access_line(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--cache-dir", str(tmp_path), "--", "--delay", "0"]
    with running_server(args, tmp_path) as server:
        usage = chat(server, "chat-1").json()["usage"]
        streamed = chat(server, "chat-2", stream=True, max_tokens=4)
        assert streamed.text.endswith("data: [DONE]\n\n")
        missing = httpx.get(f"{server.base_url}/v1/videos/video_x", headers={"x-request-id": "v"})
        assert missing.status_code == 404
        assert server.stop() == 0
    log = server.log()
    [first] = access_lines(log, "request_id=chat-1")
    tokens = f"tokens_in={usage['prompt_tokens']} tokens_out=3"
    assert "POST /v1/chat/completions 200 " in first and first.endswith(tokens)
    [second] = access_lines(log, "request_id=chat-2")
    assert "POST /v1/chat/completions 200 " in second and second.endswith("tokens_out=4")
    [video] = access_lines(log, "request_id=v")
    assert "GET /v1/videos/{video_id} 404 " in video and "tokens" not in video


def test_json_logs_are_one_object_per_line_with_fixed_keys(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--cache-dir", str(tmp_path), "--log-format", "json"]
    with running_server([*args, "--", "--delay", "0"], tmp_path) as server:
        usage = chat(server, "json-1").json()["usage"]
        assert server.stop() == 0
    records = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    [access] = [record for record in records if record.get("request_id") == "json-1"]
    assert access["logger"] == "penstock.access"
    assert {key: access[key] for key in ("method", "route", "status")} == {
        "method": "POST",
        "route": "/v1/chat/completions",
        "status": 200,
    }
    assert access["prompt_tokens"] == usage["prompt_tokens"]
    assert access["completion_tokens"] == 3
    assert isinstance(access["duration_ms"], float)


@pytest.mark.parametrize(
    ("flag", "env"), [(["--no-access-log"], {}), ([], {"PENSTOCK_ACCESS_LOG": "false"})]
)
def test_the_access_log_can_be_turned_off(
    tmp_path: Path, flag: list[str], env: dict[str, str]
) -> None:
    args = ["--engine", "sample", "--cache-dir", str(tmp_path), *flag, "--", "--delay", "0"]
    with running_server(args, tmp_path, env=env) as server:
        assert chat(server, "quiet").status_code == 200
        assert server.stop() == 0
    assert "penstock.access" not in server.log()
    assert "engine ready" in server.log()


def test_a_busy_port_fails_before_the_engine_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "penstock", "serve", "--engine", "sample", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"penstock: error: cannot listen on 127.0.0.1:{port}: the port is already in use"
    )
    assert "engine ready" not in result.stderr + result.stdout


def test_the_server_listens_on_the_port_it_bound_first(tmp_path: Path) -> None:
    args = ["--engine", "sample", "--cache-dir", str(tmp_path)]
    with running_server(args, tmp_path) as server:
        assert f"listening on http://127.0.0.1:{server.port}" in server.log()
        assert server.stop(signal.SIGTERM) == 0


def serve_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one error line ``penstock serve *args`` exits 2 with."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", *args])
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"penstock {penstock.__version__}\n"


def test_an_option_of_another_engine_names_the_engine_it_belongs_to(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert serve_error(capsys, "--engine", "sample", "--max-model-len", "4096") == (
        "penstock serve: error: --max-model-len is an option of the transformers and "
        "transformers-pooling engines; this server runs the sample engine (--engine "
        "transformers to use it)"
    )
    assert serve_error(capsys, "--delay", "0").endswith(
        "--delay is an option of the sample and sample-diffusion engines; this server runs "
        "the transformers engine (--engine sample to use it)"
    )


def test_a_vllm_option_penstock_lacks_is_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = serve_error(capsys, "--tensor-parallel-size", "2", "--max-model-len", "64")
    assert line.startswith(
        "penstock serve: error: --tensor-parallel-size is a vLLM option Penstock does not implement"
    )
    assert "vLLM option" in serve_error(capsys, "some/model", "--enforce-eager")


def test_the_vllm_engine_takes_vllm_options_as_typed() -> None:
    from penstock.app.cli import _parse

    settings, engine_args = _parse(
        [
            *("serve", "--engine", "vllm", "--model", "m", "--max-model-len", "64"),
            *("--tensor-parallel-size=1", "--enforce-eager", "--port", "9", "--", "--seed", "1"),
        ]
    )
    assert settings == {"engine": "vllm", "model": "m", "port": 9}
    assert engine_args == [
        *("--max-model-len", "64", "--tensor-parallel-size=1", "--enforce-eager"),
        *("--seed", "1"),
    ]


def test_a_class_engines_options_are_pointed_after_the_double_dash(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "tests.support.doubles:MarkedSampleEngine"
    assert serve_error(capsys, "--engine", spec, "--marker", "x").endswith(
        f"options of the engine {spec} go after --: penstock serve --engine {spec} -- --marker x"
    )


def test_the_model_is_given_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_error(capsys, "a/model", "--model", "b/model").endswith(
        "the model is given twice: a/model and --model b/model"
    )


def cache_hub_snapshot(checkpoint: Path, hf_home: Path, repo_id: str) -> None:
    """``checkpoint`` as the Hugging Face cache under ``hf_home`` keeps a downloaded
    ``repo_id``: a ref naming a commit, and that commit's snapshot folder."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(checkpoint, repo / "snapshots" / commit)


def hub_env(hf_home: Path) -> dict[str, str]:
    return {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": "1"}


def test_a_vllm_command_line_serves_a_hub_id_from_the_local_cache(tmp_path: Path) -> None:
    from tests.support.tiny_llm import build_tiny_llama

    checkpoint = build_tiny_llama(tmp_path / "tiny")
    cache_hub_snapshot(checkpoint, tmp_path / "hf", "org/tiny")
    vllm_habits = ["--max-model-len", "64", "--max-num-seqs", "2", "--dtype", "float32"]
    args = ["org/tiny", *vllm_habits, "--no-enable-prefix-caching", "--seed", "1"]
    env = hub_env(tmp_path / "hf")
    with running_server([*args, "--cpu-threads", "1"], tmp_path, env=env, ready_timeout=120) as (
        server
    ):
        models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert [model["id"] for model in models] == ["org/tiny"]
        tokenized = httpx.post(
            f"{server.base_url}/tokenize", json={"model": "org/tiny", "prompt": "hi"}
        )
        assert tokenized.json()["max_model_len"] == 64
        prompt = "one two three four five six seven eight nine ten " * 3
        body = {"model": "org/tiny", "prompt": prompt, "max_tokens": 2}
        for _ in range(2):
            usage = httpx.post(f"{server.base_url}/v1/completions", json=body).json()["usage"]
            assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert "serving org/tiny from the local Hugging Face cache" in server.log()
    assert "(float32), context 64, 2 sequences" in server.log()


def test_a_hub_id_missing_from_the_cache_says_how_to_fetch_it(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "penstock", "serve", "org/missing"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **hub_env(tmp_path / "hf")},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "penstock: error: --model org/missing: not a local folder, and not in the local "
        f"Hugging Face cache ({tmp_path / 'hf' / 'hub'}); nothing is downloaded here: fetch "
        "it first with 'hf download org/missing'"
    )


def test_vllm_api_key_guards_the_server_and_a_misnamed_key_is_warned_of(
    tmp_path: Path,
) -> None:
    args = ["--engine", "sample", "--max-tokens", "3", "--delay", "0"]
    env = {"VLLM_API_KEY": "vllm-key", "PENSTOCK_API_KEY": "misnamed"}
    with running_server(args, tmp_path, env=env) as server:
        assert chat(server, "no-key").status_code == 401
        answered = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": "sample-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer vllm-key"},
        )
        assert answered.status_code == 200
        assert answered.json()["usage"]["completion_tokens"] == 3
    [warning] = [line for line in server.log().splitlines() if "PENSTOCK_API_KEY " in line]
    assert "WARNING" in warning and "is set but not read" in warning
