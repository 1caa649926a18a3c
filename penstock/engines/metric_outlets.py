"""An engine's metric outlets, given once it has started: its own families
(``register_prometheus``), forward passes and KV snapshots, KV events.

Used by the single-process server and by each Ray replica alike, so both export the same
families with the same labels.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry

from penstock.engines.host import EngineHost
from penstock.metrics.engine_bridge import EngineMetrics, KvEventFamilies, SnapshotPublisher

logger = logging.getLogger(__name__)


async def bridge_engine_metrics(
    engine: Any,
    host: EngineHost,
    engine_metrics: EngineMetrics,
    registry: CollectorRegistry,
    model: str,
) -> None:
    """Give a started engine its metric outlets: its own families (``register_prometheus``),
    forward passes and KV snapshots, KV events, all into ``registry``."""
    worker_config = host.worker_config
    engine_metrics.auto_labels.update(
        {
            "dynamo_namespace": str(getattr(worker_config, "namespace", "penstock")),
            "dynamo_component": str(getattr(worker_config, "component", "backend")),
            "dynamo_endpoint": str(getattr(worker_config, "endpoint", "generate")),
            "worker_id": str(host.worker_id),
            "model": model,
            "model_name": model,
        }
    )
    await engine.register_prometheus(engine_metrics)
    # As Dynamo's worker: without KV routing neither KV events nor snapshots are taken.
    if host.is_raw or not getattr(worker_config, "enable_kv_routing", True):
        return
    ranks = list(engine.component_metrics_dp_ranks())
    if ranks:
        engine.attach_snapshot_publisher(SnapshotPublisher(ranks, model, registry))
    sources = list(await engine.kv_event_sources() or [])
    if sources:
        families = KvEventFamilies(model, registry)
        for source in sources:
            rank = int(getattr(source, "dp_rank", 0) or 0)
            on_ready = getattr(source, "on_ready", None)
            if callable(on_ready):
                on_ready(families.publisher(rank))
            else:
                logger.warning(
                    "KV event source %r (dp rank %d) is not a PushSource; only PushSource "
                    "events are taken in-process, so it is ignored",
                    type(source).__name__,
                    rank,
                )
