"""``/metrics`` reports what happened, in the Prometheus text format."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from penstock.engines.samples.engine import write_sample_weights
from penstock.engines.token_budget import TokenBudget
from penstock.gateway import token_budget_of
from penstock.metrics.engine_bridge import EngineMetrics, SnapshotPublisher
from penstock.metrics.forward_pass import (
    ComponentSnapshot,
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)
from penstock.metrics.frontend import MAX_WEIGHT_VERSIONS, FrontendMetrics, log_buckets
from tests.support.server import ServerProcess, running_server


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def test_requests_latency_and_tokens_are_counted(tmp_path: Path) -> None:
    with running_server(["--engine", "sample", "--", "--delay", "0.001"], tmp_path) as server:
        url = server.base_url
        body = {"model": "sample-model", "messages": [{"role": "user", "content": "hi"}]}
        httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 4})
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**body, "max_tokens": 6, "stream": True}
        ) as response:
            list(response.iter_lines())
        httpx.post(f"{url}/v1/completions", json={"model": "sample-model", "prompt": "x"})
        response = httpx.get(f"{url}/metrics")
        assert response.status_code == 200
        found = samples(response.text)
    model = ("model", "sample-model")
    ok_chat = frozenset(
        {model, ("endpoint", "chat_completions"), ("status", "success"), ("error_type", "")}
    )
    assert found[("penstock_frontend_requests_total", ok_chat | {("request_type", "unary")})] == 1
    assert found[("penstock_frontend_requests_total", ok_chat | {("request_type", "stream")})] == 1
    assert found[("penstock_frontend_time_to_first_token_seconds_count", frozenset({model}))] == 3
    assert found[("penstock_frontend_output_tokens_total", frozenset({model}))] == 4 + 6 + 16
    assert found[("penstock_frontend_active_requests", frozenset({model}))] == 0


def test_histogram_buckets_start_at_zero_and_are_log_spaced() -> None:
    buckets = log_buckets(0.001, 2.0, 13)
    assert buckets[0] == 0.0 and buckets[1] == 0.001 and buckets[-1] == 2.0
    assert buckets == sorted(set(buckets))


def test_engine_bridge_collects_callbacks_and_snapshots() -> None:
    registry = CollectorRegistry()
    publisher = SnapshotPublisher([0], "m", registry)
    publisher.publish(0, ComponentSnapshot(25, 100, 0.25, 0))
    publisher.publish(3, ComponentSnapshot(1, 1, 1.0, 3))
    bridge = EngineMetrics()
    bridge.add_expfmt_callback(lambda: "engine_up 1")
    bridge.add_expfmt_callback(lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    assert bridge.render() == "engine_up 1\n"
    labels = {"model": "m", "dp_rank": "0"}
    assert registry.get_sample_value("penstock_component_kv_used_blocks", labels) == 25
    assert registry.get_sample_value("penstock_component_kv_cache_hit_rate", labels) is None
    assert (
        registry.get_sample_value("penstock_component_total_blocks", {**labels, "dp_rank": "3"})
        is None
    )


def test_forward_passes_become_step_families_and_a_heartbeat_zeroes_the_latest_pass() -> None:
    registry = CollectorRegistry()
    publisher = SnapshotPublisher([0], "m", registry)
    scheduled = ScheduledRequestMetrics(
        num_prefill_requests=2, sum_prefill_tokens=30, num_decode_requests=3
    )
    queued = QueuedRequestMetrics(num_prefill_requests=4, sum_prefill_tokens=50)
    publisher.publish_forward_pass(
        ForwardPassMetrics(wall_time=0.02, scheduled_requests=scheduled, queued_requests=queued)
    )
    rank = {"model": "m", "dp_rank": "0"}
    value = registry.get_sample_value
    assert value("penstock_component_forward_passes_total", rank) == 1
    assert value("penstock_component_forward_pass_batch_size_sum", rank) == 5
    assert value("penstock_component_forward_pass_tokens_sum", rank) == 33
    assert value("penstock_component_scheduled_tokens_total", {**rank, "phase": "decode"}) == 3
    assert value("penstock_component_queued_requests", {**rank, "phase": "prefill"}) == 4
    assert value("penstock_component_queued_prompt_tokens", rank) == 50
    publisher.publish_forward_pass(ForwardPassMetrics())
    assert value("penstock_component_forward_passes_total", rank) == 1
    assert value("penstock_component_queued_requests", {**rank, "phase": "prefill"}) == 0
    assert value("penstock_component_scheduled_requests", {**rank, "phase": "decode"}) == 0


def test_only_the_most_recent_weight_versions_keep_token_series() -> None:
    metrics = FrontendMetrics()
    for step in range(MAX_WEIGHT_VERSIONS + 3):
        metrics.count_version_tokens("m", f"step-{step}", 10)
    metrics.count_version_tokens("m", f"step-{MAX_WEIGHT_VERSIONS + 2}", 5)
    text = generate_latest(metrics.registry).decode()
    kept = {
        sample.labels["weight_version"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "penstock_weight_version_output_tokens_total"
    }
    assert len(kept) == MAX_WEIGHT_VERSIONS
    assert "step-0" not in kept and kept[f"step-{MAX_WEIGHT_VERSIONS + 2}"] == 15


def test_an_advertised_token_budget_is_read_as_a_dict_or_json_and_bad_ones_are_ignored() -> None:
    fields = {"combined_limit": 64, "reject_prompt_overflow": True, "reject_total_overflow": False}
    assert token_budget_of({"token_budget": fields}) == TokenBudget(64, True, False)
    assert token_budget_of({"token_budget": json.dumps(fields)}) == TokenBudget(64, True, False)
    assert token_budget_of({"token_budget": {"combined_limit": -1}}) is None
    assert token_budget_of({"token_budget": "not json"}) is None
    assert token_budget_of(None) is None


# -- every documented family, after traffic that touches each ------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_ROW = re.compile(r"^\| (`[^|]+`) \| ([a-z ()]+) \| ([^|]*) \|")
# Engine-owned text of the transformers engine only.
_OTHER_ENGINES = "penstock_engine_"
# A --ray gateway's only (tests/ray/test_fleet_routing.py checks them on a real fleet).
FLEET_ONLY = "penstock_fleet_"
_MEDIA_RUN_ONLY = {"penstock_media_job_duration_seconds", "penstock_media_denoising_step_seconds"}


@dataclass(frozen=True)
class Family:
    name: str
    kind: str
    labels: frozenset[str] | None  # None: not documented in a labels column


def documented_families() -> list[Family]:
    """The rows of the tables in docs/metrics.md."""
    families = []
    for line in DOC.read_text().splitlines():
        match = _ROW.match(line)
        if match is None:
            continue
        names, kind, third = match.groups()
        columns = line.strip("|").split("|")
        labels: frozenset[str] | None = None
        if len(columns) == 4:
            text = re.sub(r"\([^)]*\)", "", third).strip()
            labels = frozenset(
                part.strip() for part in text.split(",") if part.strip() not in ("", "—")
            )
        for name in re.findall(r"`([a-z_:]+)`", names):
            families.append(Family(name, kind.split()[0], labels))
    return families


def series_labels(text: str) -> dict[str, set[frozenset[str]]]:
    """Sample name to the label-name sets it was exported with (``le``/``quantile`` out)."""
    found: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names = frozenset(sample.labels) - {"le", "quantile"}
            found.setdefault(sample.name, set()).add(names)
    return found


def assert_documented_families_present(text: str, families: list[Family]) -> None:
    exported = series_labels(text)
    for family in families:
        sample = family.name
        if family.kind in ("histogram", "summary"):
            sample = f"{family.name}_count"
        assert sample in exported, f"{family.name} ({family.kind}) is not exported"
        if family.labels is not None:
            assert exported[sample] == {family.labels}, (family.name, exported[sample])


def lint_with_promtool(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        return
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    # vLLM's names hold a colon, which promtool keeps for recording rules: they are
    # vLLM's as vLLM exports them, the one problem let through.
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line and not (line.startswith("vllm:") and line.endswith("should not contain ':'"))
    ]
    assert problems == [], result.stdout + result.stderr


@pytest.fixture(scope="module")
def sample_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir = tmp_path_factory.mktemp("metrics")
    args = ["--engine", "sample", "--", "--delay", "0.01", "--token-budget", "400"]
    with running_server(args, log_dir) as server:
        yield server


def chat(url: str, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": "sample-model", "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(
        f"{url}/v1/chat/completions", json={**body, "max_tokens": max_tokens, **extra}, timeout=30
    )


def test_every_documented_family_is_exported_after_load_and_an_rl_cycle(
    sample_server: ServerProcess, tmp_path: Path
) -> None:
    url = sample_server.base_url
    for _ in range(3):
        assert chat(url, 4).status_code == 200
    assert chat(url, 500).status_code == 400  # over the engine's token budget
    weights = tmp_path / "weights"
    weights.mkdir()
    write_sample_weights(weights, 3)
    with ThreadPoolExecutor(1) as pool:
        long_request = pool.submit(chat, url, 300)
        deadline = time.monotonic() + 10
        while (
            samples(httpx.get(f"{url}/metrics").text).get(
                ("penstock_frontend_active_requests", frozenset({("model", "sample-model")}))
            )
            != 1
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        admin = httpx.Client(base_url=url, timeout=30)
        assert admin.post("/engine/pause_generation", json={"mode": "abort"}).status_code == 200
        assert long_request.result().json()["choices"][0]["finish_reason"] == "abort"
    bad = admin.post("/engine/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert bad.status_code == 400
    update = {"model_path": str(weights), "weight_version": "step-1"}
    assert admin.post("/engine/update_weights_from_disk", json=update).status_code == 200
    assert admin.post("/engine/resume_generation").status_code == 200
    assert admin.post("/engine/control/sleep", json={"level": 1}).status_code == 200
    assert admin.post("/engine/control/wake_up").status_code == 200
    assert chat(url, 5).status_code == 200
    text = httpx.get(f"{url}/metrics").text

    families = [
        f
        for f in documented_families()
        if not f.name.startswith((_OTHER_ENGINES, FLEET_ONLY)) and f.name not in _MEDIA_RUN_ONLY
    ]
    assert_documented_families_present(text, families)
    lint_with_promtool(text)
    found = samples(text)
    model = ("model", "sample-model")
    assert found[("penstock_admin_state", frozenset({("state", "serving")}))] == 1
    assert found[("penstock_admin_state", frozenset({("state", "paused")}))] == 0
    assert found[("penstock_weight_version_info", frozenset({("weight_version", "step-1")}))] == 1
    assert found[("penstock_weight_version_changes_total", frozenset())] == 1
    assert (
        found[("penstock_admin_aborted_requests_total", frozenset({("operation", "pause")}))] >= 1
    )
    method = ("method", "update_weights_from_disk")
    assert found[("penstock_weight_update_duration_seconds_count", frozenset({method}))] == 1
    assert (
        found[
            ("penstock_weight_update_failures_total", frozenset({method, ("reason", "rejected")}))
        ]
        == 1
    )
    for operation in ("pause", "resume", "sleep", "wake_up"):
        key = ("penstock_admin_operation_duration_seconds_count", {("operation", operation)})
        assert found[(key[0], frozenset(key[1]))] == 1
    assert (
        found[
            (
                "penstock_weight_version_output_tokens_total",
                frozenset({model, ("weight_version", "step-1")}),
            )
        ]
        == 5
    )
    assert found[("penstock_frontend_model_context_length", frozenset({model}))] == 400
    rank = frozenset({model, ("dp_rank", "0")})
    assert found[("penstock_component_forward_passes_total", rank)] > 0
    assert found[("penstock_component_total_blocks", rank)] == 1000
    chat_route = frozenset(
        {("handler", "/v1/chat/completions"), ("method", "POST"), ("status", "2xx")}
    )
    assert found[("http_requests_total", chat_route)] >= 5


def test_raw_paths_and_ids_do_not_grow_the_series(sample_server: ServerProcess) -> None:
    url = sample_server.base_url

    def burst(count: int) -> None:
        with httpx.Client(base_url=url) as client:
            for _ in range(count):
                token = secrets.token_hex(8)
                assert client.get(f"/no/such/{token}").status_code == 404
                assert client.get(f"/v1/videos/video_{token}").status_code == 404

    burst(1)
    before = len(samples(httpx.get(f"{url}/metrics").text))
    burst(100)
    assert len(samples(httpx.get(f"{url}/metrics").text)) == before


def test_media_families_after_a_video_job_and_an_image(tmp_path: Path) -> None:
    args = [
        "--engine", "sample-diffusion", "--media-store", str(tmp_path / "store"),
        "--", "--endpoint-types", "images,videos", "--steps", "4", "--delay", "0.04",
    ]  # fmt: skip
    with running_server(args, tmp_path) as server, httpx.Client(base_url=server.base_url) as http:
        body = {"model": "sample-diffusion-model", "prompt": "a boat", "size": "64x64"}
        job = http.post("/v1/videos", json=body).json()
        assert http.post("/v1/images/generations", json=body).status_code == 200
        deadline = time.monotonic() + 20
        while http.get(f"/v1/videos/{job['id']}").json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        text = http.get("/metrics").text
    media = [f for f in documented_families() if f.name.startswith("penstock_media_")]
    assert_documented_families_present(text, media)
    found = samples(text)
    assert found[("penstock_media_jobs", frozenset({("status", "completed")}))] == 1
    model = ("model", "sample-diffusion-model")
    for kind in ("video", "image"):
        labels = frozenset({model, ("kind", kind), ("status", "completed")})
        assert found[("penstock_media_job_duration_seconds_count", labels)] == 1
    # 3 steps timed per generation: the first report only starts the clock.
    assert found[("penstock_media_denoising_step_seconds_count", frozenset({model}))] == 6
