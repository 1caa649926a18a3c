"""What the host hands an engine for metrics: text callbacks and a snapshot publisher."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

logger = logging.getLogger(__name__)


class EngineMetrics:
    """Handle passed to ``engine.register_prometheus``.

    Engines register callbacks returning Prometheus text; ``/metrics`` appends their
    output at scrape time.
    """

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], str]] = []

    def add_expfmt_callback(self, callback: Callable[[], str]) -> None:
        self._callbacks.append(callback)

    def render(self) -> str:
        parts = []
        for callback in self._callbacks:
            try:
                text = callback()
            except Exception:
                logger.exception("engine metrics callback failed")
                continue
            if text:
                parts.append(text if text.endswith("\n") else text + "\n")
        return "".join(parts)


class SnapshotPublisher:
    """Receives per-rank KV snapshots from an engine thread and keeps them as gauges."""

    def __init__(self, ranks: list[int], model: str, registry: CollectorRegistry) -> None:
        self.ranks = set(ranks)
        self._lock = threading.Lock()
        labels = ["model", "dp_rank"]
        self._model = model
        self.used = Gauge(
            "penstock_component_kv_used_blocks", "KV blocks in use", labels, registry=registry
        )
        self.total = Gauge(
            "penstock_component_total_blocks", "KV blocks in total", labels, registry=registry
        )
        self.usage = Gauge(
            "penstock_component_gpu_cache_usage_percent",
            "KV cache usage (0..1)",
            labels,
            registry=registry,
        )
        self.hit_rate = Gauge(
            "penstock_component_kv_cache_hit_rate",
            "Prefix cache hit rate",
            labels,
            registry=registry,
        )

    def publish(self, rank: int, snapshot: Any) -> None:
        if rank not in self.ranks:
            logger.warning("snapshot for undeclared dp rank %s ignored", rank)
            return
        labels = (self._model, str(rank))
        with self._lock:
            self.used.labels(*labels).set(snapshot.kv_used_blocks)
            self.total.labels(*labels).set(snapshot.kv_total_blocks)
            self.usage.labels(*labels).set(snapshot.gpu_cache_usage)
            if snapshot.kv_cache_hit_rate is not None:
                self.hit_rate.labels(*labels).set(snapshot.kv_cache_hit_rate)
