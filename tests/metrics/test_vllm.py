"""vLLM's families beside Penstock's: the same values under vLLM's names, labels and
histogram bounds, so that a vLLM dashboard reads a Penstock server unchanged."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from penstock.metrics.engine_bridge import SnapshotPublisher
from penstock.metrics.frontend import PREFIX, FrontendMetrics
from penstock.metrics.vllm_buckets import VLLM_TIME_TO_FIRST_TOKEN_BUCKETS
from penstock.serving.request_metrics import RequestRecorder

VLLM = {"model_name": "m", "engine": "0"}


def vllm(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(f"vllm:{name}", {**VLLM, **labels})


def test_a_request_shows_in_vllms_families_with_the_same_values() -> None:
    families = FrontendMetrics()
    registry = families.registry
    first = RequestRecorder(families, "m", 7)
    RequestRecorder(families, "m", 3)
    assert vllm(registry, "num_requests_waiting") == 2
    assert vllm(registry, "num_requests_running") == 0
    started = time.perf_counter()
    first.first_token(started + 0.03)
    assert vllm(registry, "num_requests_waiting") == 1
    assert vllm(registry, "num_requests_running") == 1
    first.flush([0.02, 0.02, 0.3], 3)
    first.succeeded()
    first.finish([], 0, 3, "completions", False, ["stop", "length"])
    assert vllm(registry, "prompt_tokens_total") == 7
    assert vllm(registry, "generation_tokens_total") == 3
    assert vllm(registry, "request_success_total", finished_reason="stop") == 1
    assert vllm(registry, "request_success_total", finished_reason="length") == 1
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert vllm(registry, f"{name}_bucket", le="0.025") == 2
        assert vllm(registry, f"{name}_bucket", le="0.2") == 2
        assert vllm(registry, f"{name}_bucket", le="0.3") == 3
        assert vllm(registry, f"{name}_count") == 3
    own = registry.get_sample_value(f"{PREFIX}inter_token_latency_seconds_sum", {"model": "m"})
    assert vllm(registry, "inter_token_latency_seconds_sum") == own
    assert vllm(registry, "e2e_request_latency_seconds_count") == 1


def test_vllms_histograms_have_vllms_bounds_and_penstocks_keep_their_own() -> None:
    families = FrontendMetrics()
    recorder = RequestRecorder(families, "m", 1)
    recorder.first_token(time.perf_counter())
    text = generate_latest(families.registry).decode()
    vllm_bounds = [
        line.split('le="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_bucket")
    ]
    assert vllm_bounds == [*(str(float(b)) for b in VLLM_TIME_TO_FIRST_TOKEN_BUCKETS), "+Inf"]
    own_bounds = [
        line
        for line in text.splitlines()
        if line.startswith(f"{PREFIX}time_to_first_token_seconds_bucket")
    ]
    assert len(own_bounds) == len(families.ttft.metric._upper_bounds)
    own = set(families.ttft.metric._upper_bounds)
    vllm_only = [bound for bound in VLLM_TIME_TO_FIRST_TOKEN_BUCKETS if bound not in own]
    assert vllm_only and f'le="{vllm_only[0]}"' not in "".join(own_bounds)
    assert (
        families.registry.get_sample_value(
            f"{PREFIX}time_to_first_token_seconds_count", {"model": "m"}
        )
        == vllm(families.registry, "time_to_first_token_seconds_count")
        == 1
    )


def test_an_aborted_choice_is_counted_as_an_abort() -> None:
    families = FrontendMetrics()
    recorder = RequestRecorder(families, "m", 1)
    recorder.failed(asyncio.CancelledError(), None)
    recorder.finish([], 0, 0, "completions", True, [None])
    assert vllm(families.registry, "request_success_total", finished_reason="abort") == 1


def test_the_engines_kv_usage_is_vllms_kv_cache_usage_perc() -> None:
    families = FrontendMetrics()
    publisher = SnapshotPublisher([0], "m", families.registry)
    snapshot = SimpleNamespace(
        kv_used_blocks=3, kv_total_blocks=12, gpu_cache_usage=0.25, kv_cache_hit_rate=None
    )
    publisher.publish(0, snapshot)
    assert vllm(families.registry, "kv_cache_usage_perc") == 0.25
