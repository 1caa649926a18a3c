"""Engines written for Dynamo run unchanged: Dynamo's own engines, from the ai-dynamo 1.6.1
wheels, through the conformance kit and a real ``penstock serve``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

try:
    from dynamo.common.backend.sample_diffusion_engine import SampleDiffusionEngine
    from dynamo.common.backend.sample_engine import SampleLLMEngine
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"SKIPPING the Dynamo engine tests: dynamo is not importable ({exc}). Install the "
        "wheels as the README test command does: pip install --no-deps "
        "ai-dynamo-runtime==1.6.1 ai-dynamo==1.6.1",
        allow_module_level=True,
    )

from penstock.engines.conformance import run_conformance
from penstock.engines.samples.engine import SAMPLE_TOKENIZER_DIR
from tests.support.server import ServerProcess, running_server, start_server

LLM = "tests.support.dynamo_engines:InstrumentedSampleEngine"
DIFFUSION = "dynamo.common.backend.sample_diffusion_engine:SampleDiffusionEngine"
SAMPLE = "dynamo.common.backend.sample_engine:SampleLLMEngine"
MODEL = "sample-model"


@pytest.fixture(scope="module")
def abort_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dynamo-aborts") / "aborts.log"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, abort_log: Path) -> Iterator[ServerProcess]:
    args = ["--engine", LLM, "--tokenizer", str(SAMPLE_TOKENIZER_DIR)]
    args += ["--", "--abort-log", str(abort_log), "--delay", "0.005", "--max-tokens", "8"]
    with running_server(args, tmp_path_factory.mktemp("dynamo-llm")) as process:
        yield process


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


async def test_dynamo_sample_engines_pass_the_conformance_kit() -> None:
    await run_conformance(SampleLLMEngine, ["--delay", "0.001"])
    await run_conformance(SampleDiffusionEngine, ["--delay", "0.001"])


def test_chat_and_completions_through_the_openai_client(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)
    reasons = [choice.finish_reason for chunk in stream for choice in chunk.choices]
    assert reasons[-1] == "length"


def test_n_is_served_by_fan_out(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, n=3, seed=5)
    assert sorted(choice.index for choice in reply.choices) == [0, 1, 2]
    assert all(choice.finish_reason == "length" for choice in reply.choices)


def test_top_logprobs_carry_exactly_k_alternatives(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(position.top_logprobs) == 2 for position in content)


def test_typed_engine_exceptions_become_client_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"temperature above 1\.5"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=1.8)
    with pytest.raises(openai.UnprocessableEntityError, match="unlucky"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=13)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_a_disconnect_aborts_exactly_once(server: ServerProcess, abort_log: Path) -> None:
    before = abort_log.read_text().splitlines() if abort_log.exists() else []
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as reply:
        next(reply.iter_lines())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = abort_log.read_text().splitlines() if abort_log.exists() else []
        if len(lines) > len(before):
            break
        time.sleep(0.05)
    time.sleep(0.3)
    new = abort_log.read_text().splitlines()[len(before) :]
    assert len(new) == 1, new


def test_bridged_families_and_kv_gauges_reach_metrics(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    client.completions.create(model=MODEL, prompt="hello there", max_tokens=2)
    time.sleep(0.3)
    text = httpx.get(f"{server.base_url}/metrics").text
    samples = {
        sample.name: sample.labels
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    labels = samples["sample_vendor:requests_total"]
    assert labels["model"] == MODEL and labels["dynamo_namespace"] == "dynamo"
    assert {"dynamo_component", "dynamo_endpoint", "worker_id", "model_name"} <= set(labels)
    for gauge in (
        "penstock_component_total_blocks",
        "penstock_component_gpu_cache_usage_percent",
        "penstock_component_kv_used_blocks",
        "penstock_component_kv_stored_blocks",
    ):
        assert samples[gauge]["dp_rank"] == "0", gauge
    assert "penstock_component_kv_events_total" in samples


def test_images_through_the_openai_client(tmp_path: Path) -> None:
    with running_server(["--engine", DIFFUSION, "--", "--delay", "0"], tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        images = client.images.generate(
            model="sample-diffusion-model", prompt="a red ball", n=2, response_format="b64_json"
        )
        assert len(images.data) == 2 and all(image.b64_json for image in images.data)


@pytest.mark.parametrize(
    ("mode", "why"),
    [("prefill", "decode worker"), ("decode", "prefill_result"), ("encode", "encoder_result")],
)
def test_each_disaggregation_mode_is_refused_at_startup(
    tmp_path: Path, mode: str, why: str
) -> None:
    args = ["--engine", SAMPLE, "--", "--disaggregation-mode", mode]
    server = start_server(args, tmp_path, wait_ready=False)
    assert server.process.wait(timeout=60) == 2
    log = server.log()
    assert f"configured as a {mode} worker" in log and why in log
    assert "run this engine aggregated" in log
