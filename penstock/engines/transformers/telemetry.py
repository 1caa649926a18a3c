"""The transformers engine's telemetry: forward passes and KV snapshots to the gateway's
publisher, and its own gauges in the Prometheus text format."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from penstock.engines.transformers.core.scheduler import KvUsage
from penstock.engines.transformers.core.step_metrics import prefix_cache_lines
from penstock.metrics.forward_pass import ComponentSnapshot, ForwardPassMetrics

if TYPE_CHECKING:
    from penstock.engines.transformers.core.scheduler import BatchScheduler
    from penstock.engines.transformers.features.vision import VisionEncoder

logger = logging.getLogger(__name__)

RECENT_FORWARD_PASSES = 256


class TransformersTelemetry:
    """Forward passes, snapshots and gauges (mixed into the engine)."""

    model: Any
    device: torch.device | None
    scheduler: BatchScheduler | None
    served_model_name: str
    vision: VisionEncoder | None

    def __init__(self) -> None:
        self.forward_pass_metrics: collections.deque[ForwardPassMetrics] = collections.deque(
            maxlen=RECENT_FORWARD_PASSES
        )
        self.latest_forward_pass_metrics: ForwardPassMetrics | None = None
        self._snapshot_publisher: Any = None
        self._publish_forward_pass: Callable[[ForwardPassMetrics], None] | None = None

    def _on_forward_pass(self, metrics: ForwardPassMetrics, usage: KvUsage) -> None:
        """Runs on the scheduler thread after every forward pass and on going idle."""
        self.forward_pass_metrics.append(metrics)
        self.latest_forward_pass_metrics = metrics
        publisher = self._snapshot_publisher
        if publisher is None:
            return
        publish_forward_pass = self._publish_forward_pass
        if publish_forward_pass is not None:
            try:
                publish_forward_pass(metrics)
            except Exception:
                logger.exception("forward-pass publisher failed")
        snapshot = ComponentSnapshot(
            kv_used_blocks=usage.used_blocks,
            kv_total_blocks=usage.total_blocks,
            gpu_cache_usage=usage.used_blocks / usage.total_blocks if usage.total_blocks else 0.0,
            dp_rank=0,
        )
        try:
            publisher.publish(0, snapshot)
        except Exception:
            logger.exception("snapshot publisher failed")

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        # Forward passes go to Penstock's publisher only; Dynamo's has no such method.
        self._publish_forward_pass = getattr(publisher, "publish_forward_pass", None)
        self._snapshot_publisher = publisher

    async def register_prometheus(self, metrics: Any) -> None:
        add_callback = getattr(metrics, "add_expfmt_callback", None)
        if callable(add_callback):
            add_callback(self.prometheus_text)

    def prometheus_text(self) -> str:
        """The engine's gauges in the Prometheus text format."""
        scheduler = self.scheduler
        usage = scheduler.usage() if scheduler is not None else KvUsage(0, 0, 0, 0)
        label = self.served_model_name.replace("\\", "\\\\").replace('"', '\\"')
        gauges = (
            ("penstock_engine_kv_used_blocks", "KV cache blocks in use", usage.used_blocks),
            ("penstock_engine_kv_total_blocks", "KV cache blocks in total", usage.total_blocks),
            ("penstock_engine_num_running", "Sequences being decoded", usage.running),
            ("penstock_engine_num_waiting", "Requests waiting to start", usage.waiting),
        )
        lines = []
        for name, help_text, value in gauges:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} gauge",
                f'{name}{{model="{label}"}} {value}',
            ]
        lines += prefix_cache_lines(usage, label)
        lines += [
            "# HELP penstock_engine_memory_bytes Memory the engine holds, by kind",
            "# TYPE penstock_engine_memory_bytes gauge",
        ]
        for kind, value in self.memory_bytes().items():
            lines.append(f'penstock_engine_memory_bytes{{model="{label}",kind="{kind}"}} {value}')
        if self.vision is not None:
            lines += self.vision.prometheus_lines(label)
        return "\n".join(lines) + "\n"

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the loaded weights (on the host while asleep, 0 once a sleep dropped them);
        on CUDA also what the allocator holds on the device."""
        model = self.model
        weights = 0
        if model is not None:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
        found = {"weights": weights}
        device = self.device
        if device is not None and device.type == "cuda":
            found["device_allocated"] = torch.cuda.memory_allocated(device)
            found["device_reserved"] = torch.cuda.memory_reserved(device)
        return found
