"""The gateway's own Prometheus metrics: requests, latency, tokens, in flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "penstock_frontend_"


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
        self._per_model: dict[str, ModelMetrics] = {}

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
