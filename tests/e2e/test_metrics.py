"""``/metrics`` reports what happened, in the Prometheus text format."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from penstock.metrics.engine_bridge import EngineMetrics, SnapshotPublisher
from penstock.metrics.forward_pass import ComponentSnapshot
from penstock.metrics.frontend import log_buckets
from tests.support.server import running_server


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
