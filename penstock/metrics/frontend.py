"""The gateway's own Prometheus metrics: requests, latency, tokens, in flight.

Also the process collectors, so one registry answers ``/metrics``, and the completion
tokens of each weight version (the one family besides the version info that carries a
version as a label: only the :data:`MAX_WEIGHT_VERSIONS` most recent keep their series).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
)

from penstock.metrics.plain import PlainCounter, PlainFamilies, PlainGauge, PlainHistogram
from penstock.metrics.vllm import VllmFamilies
from penstock.metrics.vllm_buckets import (
    VLLM_INTER_TOKEN_LATENCY_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TIME_TO_FIRST_TOKEN_BUCKETS,
)

PREFIX = "penstock_frontend_"
MAX_WEIGHT_VERSIONS = 8
NO_WEIGHT_VERSION = "none"


def log_buckets(low: float, high: float, count: int) -> list[float]:
    """``[0.0]`` then ``count - 1`` log-spaced bounds, 2 significant figures, unique."""
    ratio = (high / low) ** (1 / max(count - 2, 1))
    bounds = [0.0]
    for i in range(count - 1):
        value = float(f"{low * ratio**i:.2g}")
        if value not in bounds:
            bounds.append(value)
    return bounds


@dataclass(frozen=True)
class ModelMetrics:
    """The children of every per-model family, resolved once (``labels()`` is not free):
    plain children (:mod:`penstock.metrics.plain`), updated from the event loop only."""

    active: PlainGauge
    queued: PlainGauge
    duration: PlainHistogram
    ttft: PlainHistogram
    itl: PlainHistogram
    input_tokens: PlainHistogram
    output_tokens: PlainHistogram
    output_tokens_total: PlainCounter


class FrontendMetrics:
    """Per-gateway metric families, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # The families every request updates have plain children; the rest are
        # prometheus_client's own.
        hot = PlainFamilies()
        self.requests = hot.counter(
            f"{PREFIX}requests",
            "Finished requests",
            ["model", "endpoint", "request_type", "status", "error_type"],
        )
        self.active = hot.gauge(f"{PREFIX}active_requests", "Requests being served", ["model"])
        self.queued = hot.gauge(
            f"{PREFIX}queued_requests", "Requests waiting for a first token", ["model"]
        )
        self._latency_families(hot)
        self.input_tokens = hot.histogram(
            f"{PREFIX}input_sequence_tokens",
            "Prompt tokens per request",
            ["model"],
            buckets=log_buckets(50, 128000, 12),
        )
        self.output_tokens = hot.histogram(
            f"{PREFIX}output_sequence_tokens",
            "Completion tokens per request",
            ["model"],
            buckets=log_buckets(50, 32000, 10),
        )
        self.output_tokens_total = hot.counter(
            f"{PREFIX}output_tokens", "Completion tokens streamed", ["model"]
        )
        self.finished_choices = hot.counter(
            f"{PREFIX}finished_choices",
            "Choices finished, by how: stop, length, abort or error",
            ["model", "finish_reason"],
        )
        r.register(hot)
        self.context_length = Gauge(
            f"{PREFIX}model_context_length",
            "Token limit prompts are checked against (TokenBudget or context length)",
            ["model"],
            registry=r,
        )
        self.token_budget_enforced = Gauge(
            f"{PREFIX}model_token_budget_enforced",
            "1 when the gateway rejects this overflow, 0 when the engine owns it",
            ["model", "overflow"],
            registry=r,
        )
        self.version_tokens = Counter(
            "penstock_weight_version_output_tokens",
            f"Completion tokens per weight version (the {MAX_WEIGHT_VERSIONS} most recent)",
            ["model", "weight_version"],
            registry=r,
        )
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self._per_model: dict[str, ModelMetrics] = {}
        self._versions: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._versions_lock = threading.Lock()
        r.register(VllmFamilies(self))

    def _latency_families(self, hot: PlainFamilies) -> None:
        # Counted at vLLM's bounds too, which its families show (``metrics.vllm``).
        self.duration = hot.histogram(
            f"{PREFIX}request_duration_seconds",
            "Request duration",
            ["model"],
            buckets=log_buckets(1.0, 512, 10),
            finer=VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.ttft = hot.histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=log_buckets(0.001, 480, 18),
            finer=VLLM_TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.itl = hot.histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Latency between tokens",
            ["model"],
            buckets=log_buckets(0.001, 2.0, 13),
            finer=VLLM_INTER_TOKEN_LATENCY_BUCKETS,
        )

    def models(self) -> list[tuple[str, ModelMetrics]]:
        """Every model's children so far (read from any thread)."""
        return list(self._per_model.items())

    def for_model(self, model: str) -> ModelMetrics:
        children = self._per_model.get(model)
        if children is None:
            children = ModelMetrics(
                active=self.active.labels(model),
                queued=self.queued.labels(model),
                duration=self.duration.labels(model),
                ttft=self.ttft.labels(model),
                itl=self.itl.labels(model),
                input_tokens=self.input_tokens.labels(model),
                output_tokens=self.output_tokens.labels(model),
                output_tokens_total=self.output_tokens_total.labels(model),
            )
            self._per_model[model] = children
        return children

    def set_token_limits(
        self, model: str, limit: int | None, reject_prompt: bool, reject_total: bool
    ) -> None:
        """Show the token limit the gateway applies to ``model`` and which overflows act;
        nothing for a model with no limit (the gateway checks nothing then)."""
        if limit is None:
            return
        self.context_length.labels(model).set(limit)
        self.token_budget_enforced.labels(model, "prompt").set(int(reject_prompt))
        self.token_budget_enforced.labels(model, "total").set(int(reject_total))

    def count_version_tokens(self, model: str, version: str | None, tokens: int) -> None:
        """Add ``tokens`` to ``version``; the least recently seen version past the bound
        loses its series."""
        key = (model, version or NO_WEIGHT_VERSION)
        with self._versions_lock:
            child = self._versions.get(key)
            if child is None:
                child = self.version_tokens.labels(*key)
                self._versions[key] = child
                while len(self._versions) > MAX_WEIGHT_VERSIONS:
                    old, _ = self._versions.popitem(last=False)
                    self.version_tokens.remove(*old)
            else:
                self._versions.move_to_end(key)
        child.inc(tokens)
