"""What the host hands an engine for metrics: text callbacks, a snapshot publisher and
KV event publishers.

:class:`EngineMetrics` offers what Dynamo's Rust ``EngineMetrics`` does, so
``dynamo.common.backend.metrics.register_engine_registry`` / ``register_global_registry``
work unchanged: ``auto_labels`` (injected into every bridged series),
``register_prometheus_expfmt_callback`` (text appended to ``/metrics``) and
``register_prometheus_typed_callback`` (Dynamo's OTLP feed; kept, not exported, since the
same families already reach ``/metrics`` as text).

The publisher is Penstock's stand-in for Dynamo's Rust-owned ``SnapshotPublisher``: besides
the seed's ``publish(rank, snapshot)`` for KV snapshots, it takes one
:class:`~penstock.metrics.forward_pass.ForwardPassMetrics` per scheduler iteration through
``publish_forward_pass`` (Dynamo ships those over ZMQ to its event plane; in one process
they go straight into Prometheus families). Both are called from engine threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from penstock.metrics.forward_pass import ForwardPassMetrics
from penstock.metrics.frontend import log_buckets
from penstock.metrics.vllm import watch_kv_usage

logger = logging.getLogger(__name__)


class EngineMetrics:
    """Handle passed to ``engine.register_prometheus``.

    Engines register callbacks returning Prometheus text; ``/metrics`` appends their
    output at scrape time. ``auto_labels`` are Dynamo's (``dynamo_namespace``,
    ``dynamo_component``, ``dynamo_endpoint``, ``worker_id``, ``model``, ``model_name``),
    set by the gateway before ``register_prometheus`` runs.
    """

    def __init__(self, auto_labels: dict[str, str] | None = None) -> None:
        self._callbacks: list[Callable[[], str]] = []
        self._typed_callbacks: list[Callable[[], list[Any]]] = []
        self.auto_labels: dict[str, str] = dict(auto_labels or {})

    def add_expfmt_callback(self, callback: Callable[[], str]) -> None:
        self._callbacks.append(callback)

    def register_prometheus_expfmt_callback(self, callback: Callable[[], str]) -> None:
        """Dynamo's name for :meth:`add_expfmt_callback`."""
        self._callbacks.append(callback)

    def register_prometheus_typed_callback(self, callback: Callable[[], list[Any]]) -> None:
        """Families as ``(name, help, type, unit, samples)`` tuples (Dynamo's OTLP feed)."""
        self._typed_callbacks.append(callback)

    def typed(self) -> list[Any]:
        """Every typed callback's families, a failing callback skipped."""
        families: list[Any] = []
        for callback in self._typed_callbacks:
            try:
                families.extend(callback())
            except Exception:
                logger.exception("engine typed metrics callback failed")
        return families

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


class _RankFamilies:
    """The forward-pass children of one dp rank, bound once."""

    __slots__ = (
        "batch_size",
        "decode_tokens",
        "duration",
        "passes",
        "prefill_tokens",
        "queued_decode",
        "queued_prefill",
        "queued_prompt_tokens",
        "scheduled_decode",
        "scheduled_prefill",
        "tokens",
    )

    def __init__(self, publisher: SnapshotPublisher, labels: tuple[str, str]) -> None:
        self.passes = publisher.passes.labels(*labels)
        self.duration = publisher.pass_duration.labels(*labels)
        self.batch_size = publisher.batch_size.labels(*labels)
        self.tokens = publisher.pass_tokens.labels(*labels)
        self.prefill_tokens = publisher.scheduled_tokens.labels(*labels, "prefill")
        self.decode_tokens = publisher.scheduled_tokens.labels(*labels, "decode")
        self.scheduled_prefill = publisher.scheduled.labels(*labels, "prefill")
        self.scheduled_decode = publisher.scheduled.labels(*labels, "decode")
        self.queued_prefill = publisher.queued.labels(*labels, "prefill")
        self.queued_decode = publisher.queued.labels(*labels, "decode")
        self.queued_prompt_tokens = publisher.queued_prompt_tokens.labels(*labels)


class SnapshotPublisher:
    """Keeps an engine's per-rank KV snapshots and forward passes as Prometheus families."""

    def __init__(self, ranks: list[int], model: str, registry: CollectorRegistry) -> None:
        self.ranks = set(ranks)
        # The latest usage of each rank, by the rank's label, shown by vLLM's name too.
        self.latest_usage: dict[str, float] = {}
        watch_kv_usage(registry, self.kv_usage)
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
        self.passes = Counter(
            "penstock_component_forward_passes",
            "Forward passes (scheduler iterations), idle heartbeats excluded",
            labels,
            registry=registry,
        )
        self.pass_duration = Histogram(
            "penstock_component_forward_pass_duration_seconds",
            "Wall time of one forward pass",
            labels,
            buckets=log_buckets(0.0001, 10.0, 16),
            registry=registry,
        )
        self.batch_size = Histogram(
            "penstock_component_forward_pass_batch_size",
            "Requests scheduled in one forward pass (prefill + decode)",
            labels,
            buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
            registry=registry,
        )
        self.pass_tokens = Histogram(
            "penstock_component_forward_pass_tokens",
            "Tokens computed in one forward pass (prompt tokens prefilled + one per decode)",
            labels,
            buckets=[1, 4, 16, 64, 256, 1024, 4096, 16384, 65536],
            registry=registry,
        )
        self.scheduled_tokens = Counter(
            "penstock_component_scheduled_tokens",
            "Tokens computed: prompt tokens prefilled, tokens decoded",
            [*labels, "phase"],
            registry=registry,
        )
        self.scheduled = Gauge(
            "penstock_component_scheduled_requests",
            "Requests scheduled in the latest forward pass",
            [*labels, "phase"],
            registry=registry,
        )
        self.queued = Gauge(
            "penstock_component_queued_requests",
            "Requests waiting after the latest forward pass (decode: preempted)",
            [*labels, "phase"],
            registry=registry,
        )
        self.queued_prompt_tokens = Gauge(
            "penstock_component_queued_prompt_tokens",
            "Prompt tokens of the requests waiting to be prefilled",
            labels,
            registry=registry,
        )
        self._ranks = {rank: _RankFamilies(self, (model, str(rank))) for rank in self.ranks}

    def publish_forward_pass(self, metrics: ForwardPassMetrics) -> None:
        """Record one forward pass; a heartbeat only zeroes the latest-pass gauges."""
        families = self._ranks.get(metrics.dp_rank)
        if families is None:
            logger.warning("forward pass for undeclared dp rank %s ignored", metrics.dp_rank)
            return
        scheduled = metrics.scheduled_requests
        queued = metrics.queued_requests
        families.scheduled_prefill.set(scheduled.num_prefill_requests)
        families.scheduled_decode.set(scheduled.num_decode_requests)
        families.queued_prefill.set(queued.num_prefill_requests)
        families.queued_decode.set(queued.num_decode_requests)
        families.queued_prompt_tokens.set(queued.sum_prefill_tokens)
        if metrics.is_heartbeat:
            return
        families.passes.inc()
        families.duration.observe(metrics.wall_time)
        families.batch_size.observe(scheduled.num_prefill_requests + scheduled.num_decode_requests)
        families.tokens.observe(scheduled.sum_prefill_tokens + scheduled.num_decode_requests)
        if scheduled.sum_prefill_tokens:
            families.prefill_tokens.inc(scheduled.sum_prefill_tokens)
        if scheduled.num_decode_requests:
            families.decode_tokens.inc(scheduled.num_decode_requests)

    def kv_usage(self) -> list[tuple[str, str, float]]:
        return [(self._model, rank, usage) for rank, usage in list(self.latest_usage.items())]

    def publish(self, rank: int, snapshot: Any) -> None:
        if rank not in self.ranks:
            logger.warning("snapshot for undeclared dp rank %s ignored", rank)
            return
        labels = (self._model, str(rank))
        with self._lock:
            self.used.labels(*labels).set(snapshot.kv_used_blocks)
            self.total.labels(*labels).set(snapshot.kv_total_blocks)
            self.usage.labels(*labels).set(snapshot.gpu_cache_usage)
            self.latest_usage[labels[1]] = snapshot.gpu_cache_usage
            if snapshot.kv_cache_hit_rate is not None:
                self.hit_rate.labels(*labels).set(snapshot.kv_cache_hit_rate)


class KvEventPublisher:
    """What a ``PushSource``'s ``on_ready`` receives: one per data-parallel rank.

    Dynamo relays these events to its KV router; a single-process gateway has no router,
    so they are counted (``penstock_component_kv_events_total``) and the blocks they
    leave stored tracked (``penstock_component_kv_stored_blocks``) for dashboards; each
    event is logged at DEBUG. Called from engine threads.
    """

    def __init__(self, families: KvEventFamilies, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        labels = (families.model, str(dp_rank))
        self._stored = families.events.labels(*labels, "stored")
        self._removed = families.events.labels(*labels, "removed")
        self._cleared = families.events.labels(*labels, "cleared")
        self._blocks = families.blocks.labels(*labels)
        self._lock = threading.Lock()
        self._live: set[int] = set()

    def publish_stored(
        self,
        token_ids: list[int],
        num_block_tokens: list[int],
        block_hashes: list[int],
        parent_hash: int | None = None,
        **extra: Any,
    ) -> None:
        if len(num_block_tokens) != len(block_hashes):
            raise ValueError("num_block_tokens and block_hashes must have the same length")
        with self._lock:
            self._live.update(block_hashes)
            self._blocks.set(len(self._live))
        self._stored.inc()
        logger.debug(
            "kv stored rank=%d blocks=%s parent=%s", self.dp_rank, block_hashes, parent_hash
        )

    def publish_removed(self, block_hashes: list[int]) -> None:
        with self._lock:
            self._live.difference_update(block_hashes)
            self._blocks.set(len(self._live))
        self._removed.inc()
        logger.debug("kv removed rank=%d blocks=%s", self.dp_rank, block_hashes)

    def clear_all(self) -> None:
        with self._lock:
            self._live.clear()
            self._blocks.set(0)
        self._cleared.inc()


class KvEventFamilies:
    """The KV event families of one served model."""

    def __init__(self, model: str, registry: CollectorRegistry) -> None:
        self.model = model
        labels = ["model", "dp_rank"]
        self.events = Counter(
            "penstock_component_kv_events",
            "KV cache events an engine published (stored, removed, cleared)",
            [*labels, "kind"],
            registry=registry,
        )
        self.blocks = Gauge(
            "penstock_component_kv_stored_blocks",
            "KV blocks stored and not yet removed, by the engine's KV events",
            labels,
            registry=registry,
        )

    def publisher(self, dp_rank: int) -> KvEventPublisher:
        return KvEventPublisher(self, dp_rank)
