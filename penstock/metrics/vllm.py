"""vLLM's metric families, read off Penstock's own at each scrape, so that a dashboard or
an autoscaler written for vLLM works unchanged.

Each ``vllm:*`` family shows values Penstock already keeps (nothing is measured twice on a
request's path): the frontend's per-model children (:mod:`penstock.metrics.frontend`),
whose histograms count at vLLM's bounds too, and the engine's KV snapshots
(:mod:`penstock.metrics.engine_bridge`). Labels are vLLM's: ``model_name`` and
``engine`` (the data-parallel rank; ``0`` for the gateway's own measurements).

| vLLM family | from |
|---|---|
| ``vllm:num_requests_running`` | requests being served past their first token |
| ``vllm:num_requests_waiting`` | requests waiting for their first token |
| ``vllm:kv_cache_usage_perc`` | the engine's KV snapshot (0..1), per rank |
| ``vllm:time_to_first_token_seconds`` | time to first token |
| ``vllm:inter_token_latency_seconds`` | latency between tokens |
| ``vllm:time_per_output_token_seconds`` | the same (its name before vLLM 0.11) |
| ``vllm:e2e_request_latency_seconds`` | request duration |
| ``vllm:prompt_tokens_total`` | prompt tokens of requests that reached a first token |
| ``vllm:generation_tokens_total`` | completion tokens streamed |
| ``vllm:request_success_total{finished_reason}`` | finished choices by finish reason |
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from penstock.metrics.plain import PlainHistogram
from penstock.metrics.vllm_buckets import (
    VLLM_INTER_TOKEN_LATENCY_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TIME_TO_FIRST_TOKEN_BUCKETS,
)

if TYPE_CHECKING:
    from penstock.metrics.frontend import FrontendMetrics

LABELS = ["model_name", "engine"]
# The families built here (counters without their ``_total``): an engine bridging vLLM's
# own statistics leaves these names to the gateway.
FAMILY_NAMES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
    }
)
GATEWAY_ENGINE = "0"

KvUsageSource = Callable[[], list[tuple[str, str, float]]]
# Each registry's KV usage sources: ``(model, rank, usage 0..1)`` of an engine's latest
# snapshots (``engine_bridge.SnapshotPublisher``).
_KV_USAGE: weakref.WeakKeyDictionary[CollectorRegistry, list[KvUsageSource]] = (
    weakref.WeakKeyDictionary()
)


def watch_kv_usage(registry: CollectorRegistry, source: KvUsageSource) -> None:
    """Show ``source``'s KV usage as ``vllm:kv_cache_usage_perc`` in ``registry``."""
    _KV_USAGE.setdefault(registry, []).append(source)


class VllmFamilies(Collector):
    """The ``vllm:*`` families of one :class:`FrontendMetrics`, built when collected."""

    def __init__(self, frontend: FrontendMetrics) -> None:
        self._frontend = frontend

    def describe(self) -> list[Any]:
        # Families made at collection: nothing to check for clashes at registration.
        return []

    def collect(self) -> Iterator[Any]:
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels=LABELS,
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels=LABELS,
        )
        ttft = _histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."
        )
        itl = _histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."
        )
        tpot = _histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the inter-token latency).",
        )
        e2e = _histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=LABELS
        )
        generation = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels=LABELS
        )
        for model, metrics in self._frontend.models():
            labels = [model, GATEWAY_ENGINE]
            queued = metrics.queued.value
            running.add_metric(labels, metrics.active.value - queued)
            waiting.add_metric(labels, queued)
            _add(ttft, labels, metrics.ttft, VLLM_TIME_TO_FIRST_TOKEN_BUCKETS)
            _add(itl, labels, metrics.itl, VLLM_INTER_TOKEN_LATENCY_BUCKETS)
            _add(tpot, labels, metrics.itl, VLLM_INTER_TOKEN_LATENCY_BUCKETS)
            _add(e2e, labels, metrics.duration, VLLM_REQUEST_LATENCY_BUCKETS)
            prompt.add_metric(labels, metrics.input_tokens.sum)
            generation.add_metric(labels, metrics.output_tokens_total.total)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for (model, reason), counter in self._frontend.finished_choices.children():
            success.add_metric([model, GATEWAY_ENGINE, reason], counter.total)
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=LABELS
        )
        for source in list(_KV_USAGE.get(self._frontend.registry, ())):
            for model, rank, value in source():
                usage.add_metric([model, rank], value)
        yield from (running, waiting, usage, ttft, itl, tpot, e2e, prompt, generation, success)


def _histogram(name: str, documentation: str) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, labels=LABELS)


def _add(
    family: HistogramMetricFamily,
    labels: list[str],
    child: PlainHistogram,
    bounds: Sequence[float],
) -> None:
    """``child``'s counts at vLLM's ``bounds``: each is one of the child's own, so every
    cumulative count is exact."""
    counts = list(child.counts)
    total = child.sum
    cumulative: list[tuple[str, float]] = []
    for bound in bounds:
        cumulative.append(
            (floatToGoString(bound), sum(counts[: bisect_right(child.bounds, bound)]))
        )
    cumulative.append(("+Inf", sum(counts)))
    family.add_metric(labels, cumulative, total)
