"""The gateway's own Prometheus metrics: requests, latency, tokens, in flight.

Also the process collectors, so one registry answers ``/metrics``, and the completion
tokens of each weight version (the one family besides the version info that carries a
version as a label: only the :data:`MAX_WEIGHT_VERSIONS` most recent keep their series).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
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


def observe_many(histogram: Any, amounts: Iterable[float]) -> None:
    """``histogram.observe`` for each of ``amounts``, with one increment per bucket and
    one of the sum: the same counts, for the per-token families a stream flushes in
    batches (``histogram`` is a labelled child or an unlabelled histogram)."""
    bounds = histogram._upper_bounds
    hits = [0] * len(bounds)
    total = 0.0
    for amount in amounts:
        total += amount
        hits[bisect_left(bounds, amount)] += 1
    if not any(hits):
        return
    histogram._sum.inc(total)
    for bucket, count in zip(histogram._buckets, hits, strict=True):
        if count:
            bucket.inc(count)


@dataclass(frozen=True)
class ModelMetrics:
    """The children of every per-model family, resolved once (``labels()`` is not free)."""

    active: Any
    queued: Any
    duration: Any
    ttft: Any
    itl: Any
    input_tokens: Any
    output_tokens: Any
    output_tokens_total: Any


class FrontendMetrics:
    """Per-gateway metric families, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}requests",
            "Finished requests",
            ["model", "endpoint", "request_type", "status", "error_type"],
            registry=r,
        )
        self.active = Gauge(
            f"{PREFIX}active_requests", "Requests being served", ["model"], registry=r
        )
        self.queued = Gauge(
            f"{PREFIX}queued_requests", "Requests waiting for a first token", ["model"], registry=r
        )
        self.duration = Histogram(
            f"{PREFIX}request_duration_seconds",
            "Request duration",
            ["model"],
            buckets=log_buckets(1.0, 512, 10),
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=log_buckets(0.001, 480, 18),
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Latency between tokens",
            ["model"],
            buckets=log_buckets(0.001, 2.0, 13),
            registry=r,
        )
        self.input_tokens = Histogram(
            f"{PREFIX}input_sequence_tokens",
            "Prompt tokens per request",
            ["model"],
            buckets=log_buckets(50, 128000, 12),
            registry=r,
        )
        self.output_tokens = Histogram(
            f"{PREFIX}output_sequence_tokens",
            "Completion tokens per request",
            ["model"],
            buckets=log_buckets(50, 32000, 10),
            registry=r,
        )
        self.output_tokens_total = Counter(
            f"{PREFIX}output_tokens", "Completion tokens streamed", ["model"], registry=r
        )
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
