"""vLLM's engine statistics on the gateway's ``/metrics``.

``AsyncLLM`` records its scheduler's statistics (prefix cache queries and hits,
preemptions, iteration tokens, queue, prefill and decode times, ...) into
``prometheus_client``'s global registry in the gateway's process. The families the
gateway already builds under the same names from its own measurements
(:data:`penstock.metrics.vllm.FAMILY_NAMES`) stay the gateway's; every other ``vllm:*``
family is appended to ``/metrics`` as vLLM wrote it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from penstock.metrics.vllm import FAMILY_NAMES


class EngineStatistics(Collector):
    """vLLM's own ``vllm:*`` families, less the gateway's."""

    def collect(self) -> Iterator[Any]:
        for family in REGISTRY.collect():
            if family.name.startswith("vllm:") and family.name not in FAMILY_NAMES:
                yield family


def statistics_text() -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatistics())
    return generate_latest(registry).decode()
