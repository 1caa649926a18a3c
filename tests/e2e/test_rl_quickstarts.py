"""``docs/rl-trainers.md``'s quick-starts, each against a real ``penstock serve`` (sample
engine): the test reads each framework's configuration block from the page, turns it
into the URLs, headers and keys that framework's client code derives from it (the
address ``127.0.0.1:8000`` becomes the test server's), and sends the calls that client
makes with them.

Frameworks that send no key meet a server without ``--admin-api-key``, called from
loopback; prime-rl meets one started with ``--admin-api-key "$VLLM_API_KEY"``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from penstock.engines.samples.engine import write_sample_weights
from tests.support.server import ServerProcess, running_servers

DOC = Path(__file__).resolve().parents[2] / "docs" / "rl-trainers.md"
DOC_ADDRESS = "127.0.0.1:8000"
MODEL = "sample-model"
KEY = "quickstart-admin-key"
PROMPT = [5, 6, 7]


def quickstart(framework: str) -> str:
    """The code blocks of the framework's quick-start, joined."""
    section = DOC.read_text().split("## Quick-starts", 1)[1]
    part = section.split(f"### {framework}\n", 1)[1].split("\n### ", 1)[0]
    return "\n".join(re.findall(r"```[a-z]*\n(.*?)```", part, flags=re.DOTALL))


def setting(framework: str, pattern: str) -> str:
    found = re.search(pattern, quickstart(framework))
    assert found is not None, f"{framework}'s quick-start has no {pattern!r}"
    return found.group(1)


def on(server: ServerProcess, value: str) -> str:
    """A documented address or URL, on the test server."""
    assert DOC_ADDRESS in value
    return value.replace(DOC_ADDRESS, server.base_url.removeprefix("http://"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    log_dir = tmp_path_factory.mktemp("quickstarts")
    starts = [
        (["--engine", "sample"], log_dir),
        (["--engine", "sample", "--admin-api-key", KEY], log_dir),
    ]
    with running_servers(starts) as running:
        yield running


@pytest.fixture(scope="module")
def keyless(servers: list[ServerProcess]) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers: list[ServerProcess]) -> ServerProcess:
    return servers[1]


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, f"{response.request.url}: {response.text}"
    return response.json() if response.content else None


def weights(tmp_path: Path, shift: int) -> str:
    folder = tmp_path / f"shift-{shift}"
    folder.mkdir()
    write_sample_weights(folder, shift)
    return str(folder)


def sglang_generate(http: httpx.Client, **extra: Any) -> list[int]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 3, "temperature": 1.0},
        "return_logprob": True,
        **extra,
    }
    return list(ok(http.post("/generate", json=body))["output_ids"])


def test_slime_with_external_engine_addrs(keyless: ServerProcess, tmp_path: Path) -> None:
    assert "--trust-weight-payloads" in quickstart("slime")
    address = on(keyless, setting("slime", r"--rollout-external-engine-addrs (\S+)"))
    # slime's requests carry its unset ``api_key``.
    headers = {"Authorization": "Bearer None"}
    with httpx.Client(base_url=f"http://{address}", headers=headers, timeout=30) as slime:
        for path in ("/server_info", "/get_server_info"):
            assert ok(slime.get(path))["tp_size"] == 1
        assert slime.get("/health_generate").status_code == 200
        before = sglang_generate(slime)
        ok(slime.post("/pause_generation", json={}))
        ok(slime.post("/update_weights_from_disk", json={"model_path": weights(tmp_path, 2)}))
        ok(slime.post("/continue_generation", json={}))
        assert slime.get("/flush_cache").status_code == 200
        assert sglang_generate(slime) != before
        ok(slime.post("/abort_request", json={"abort_all": True}))


def test_skyrl_with_external_urls(keyless: ServerProcess) -> None:
    proxy = on(keyless, setting("SkyRL", r'external_proxy_url="([^"]+)"'))
    urls = setting("SkyRL", r'external_server_urls="(\[[^"]+\])"')
    (server,) = [on(keyless, url) for url in re.findall(r"'([^']+)'", urls)]
    with httpx.Client(base_url=server, timeout=30) as control:
        assert ok(control.get("/get_world_size"))["world_size"] == 1
        ok(control.post("/pause", params={"mode": "keep", "clear_cache": "false"}))
        ok(control.post("/resume"))
        ok(control.post("/reset_prefix_cache", json={"reset_running_requests": False}))
    body = {"sampling_params": {"max_tokens": 3}, "model": MODEL, "token_ids": PROMPT}
    with httpx.Client(base_url=proxy, timeout=30) as data:
        assert (
            len(ok(data.post("/inference/v1/generate", json=body))["choices"][0]["token_ids"]) == 3
        )


def test_prime_rl_with_its_client_config(
    keyed: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert '--admin-api-key "$VLLM_API_KEY"' in quickstart("prime-rl")
    base_url = on(keyed, setting("prime-rl", r'base_url = "([^"]+)"'))
    # ``export VLLM_API_KEY=...``, read back as prime-rl's clients read it.
    key_var = setting("prime-rl", r'api_key_var = "([^"]+)"')
    monkeypatch.setenv(key_var, KEY)
    headers = {"Authorization": f"Bearer {os.environ[key_var]}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as inference:
        assert MODEL in [model["id"] for model in ok(inference.get(f"{base_url}/models"))["data"]]
    admin_url = base_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(base_url=admin_url, timeout=30) as anonymous:
        assert anonymous.post("/pause", params={"mode": "keep"}).status_code == 401
    with httpx.Client(base_url=admin_url, headers=headers, timeout=30) as admin:
        ok(admin.get("/health"))
        ok(admin.get("/liveness"))
        ok(admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}))
        ok(admin.post("/update_weights", json={"weight_dir": weights(tmp_path, 0)}))
        ok(admin.post("/resume"))


def test_verl_adapter_pointed_at_penstock(keyless: ServerProcess) -> None:
    assert "--trust-weight-payloads" in quickstart("verl")
    host = setting("verl", r'host="([^"]+)"')
    port = setting("verl", r"port=(\d+)")
    url = f"http://{on(keyless, f'{host}:{port}')}"
    # ``AsyncHttpServerAdapter._make_async_request``: no headers.
    with httpx.Client(base_url=url, timeout=30) as verl:
        assert len(sglang_generate(verl)) == 3
        ok(verl.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}))
        ok(verl.post("/resume_memory_occupation", json={"tags": ["weights"]}))
        ok(verl.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}))
        assert (
            ok(verl.post("/abort_request", json={"rid": "", "abort_all": False}))["aborted"] == []
        )
        assert verl.get("/flush_cache").status_code == 200
        assert len(sglang_generate(verl)) == 3


def test_areal_with_its_server_addrs(keyless: ServerProcess, tmp_path: Path) -> None:
    (address,) = on(keyless, setting("AReaL", r"AREAL_LLM_SERVER_ADDRS=(\S+)")).split(",")
    with httpx.Client(base_url=f"http://{address}", timeout=30) as areal:
        ok(areal.get("/health"))
        # ``RemoteSGLangEngine``: a text rollout, a disk update.
        # AReaL's text rollouts send an empty image list.
        assert len(sglang_generate(areal, stream=False, image_data=[])) == 3
        ok(areal.post("/pause_generation", json={}))
        update = {"model_path": weights(tmp_path, 0), "abort_all_requests": True}
        ok(areal.post("/update_weights_from_disk", json=update))
        ok(areal.post("/continue_generation", json={}))
        # ``RemotevLLMEngine``'s control calls.
        ok(areal.post("/areal_pause_generation", json={}))
        ok(areal.post("/areal_update_weights", json={"model_path": weights(tmp_path, 1)}))
        ok(areal.post("/areal_continue_generation", json={}))
        ok(areal.post("/sleep", json={}))
        ok(areal.post("/wake_up?tags=weights&tags=kv_cache", json={}))
        assert len(sglang_generate(areal, stream=False)) == 3


def test_trl_client_pointed_at_penstock(keyless: ServerProcess) -> None:
    base_url = on(keyless, setting("TRL", r'VLLMClient\(base_url="([^"]+)"\)'))
    with httpx.Client(base_url=base_url, timeout=30) as trl:
        assert ok(trl.get("/health/")) == {"status": "ok"}
        body = {"prompts": [PROMPT], "n": 1, "max_tokens": 3, "logprobs": 0}
        assert len(ok(trl.post("/generate/", json=body))["completion_ids"][0]) == 3
        refused = trl.post(
            "/init_communicator/",
            json={"host": "0.0.0.0", "port": 51216, "world_size": 2, "client_device_uuid": "0"},
        )
        assert refused.status_code == 400 and "NCCL" in refused.json()["error"]["message"]


def test_openrlhf_has_no_server_setting() -> None:
    assert quickstart("OpenRLHF") == ""
    assert "None: OpenRLHF creates vLLM engines inside its Ray actors" in DOC.read_text()
