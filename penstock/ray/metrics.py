"""Metrics of a Ray fleet, served by the ingress's ``/metrics`` with a ``replica`` label.

Each replica bridges its engine's metrics (forward passes, KV snapshots and events, the
engine's own text callbacks) into a registry of its own (:class:`ReplicaMetrics`), as the
single-process server does into its gateway's. At scrape time the ingress asks every
replica for that text through ``DeploymentHandle.broadcast`` (bounded by
:data:`SCRAPE_TIMEOUT_S`: a replica that fails is left out of that scrape, and when the
replies do not all arrive in time the scrape carries the ingress's view only),
adds ``replica="<its Serve actor name>"`` to every series and merges the families.

Beside them, the ingress's own view of each replica (:func:`fleet_families`):
``penstock_fleet_replica_requests_total``, ``penstock_fleet_replica_running_requests``,
``penstock_fleet_replica_output_tokens_total``, ``penstock_fleet_replica_lost_requests_total``
and ``penstock_fleet_replica_up`` (1 for a replica that answered this scrape); a replica's
series leave with it, so ``penstock_fleet_lost_requests_total`` counts the requests lost
to every replica's death since the ingress started, the dead ones' included.
Every family is in ``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from penstock.metrics.engine_bridge import EngineMetrics

REPLICA_LABEL = "replica"
SCRAPE_TIMEOUT_S = 5.0


class ReplicaMetrics:
    """One replica's engine metric families."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine_metrics = EngineMetrics()

    def render(self) -> str:
        return generate_latest(self.registry).decode() + self.engine_metrics.render()


def _family(name: str, documentation: str, kind: str) -> Metric:
    return Metric(name, documentation, kind)


def fleet_families(
    loads: Mapping[str, Any], answered: Iterable[str], lost_in_all: int
) -> list[Metric]:
    """The ingress's view of each replica: ``loads`` maps a replica to its ``ReplicaLoad``;
    ``lost_in_all``: the requests lost to any replica, live or gone."""
    requests = _family(
        "penstock_fleet_replica_requests", "Requests the ingress routed to the replica", "counter"
    )
    running = _family(
        "penstock_fleet_replica_running_requests",
        "Requests running on the replica, as the ingress sees them",
        "gauge",
    )
    tokens = _family(
        "penstock_fleet_replica_output_tokens",
        "Output tokens the replica generated for the ingress",
        "counter",
    )
    lost = _family(
        "penstock_fleet_replica_lost_requests",
        "Requests that failed because the replica died",
        "counter",
    )
    up = _family(
        "penstock_fleet_replica_up", "1 when the replica answered this metrics scrape", "gauge"
    )
    fleet_lost = _family(
        "penstock_fleet_lost_requests",
        "Requests that failed because their replica died, every replica's (gone ones too)",
        "counter",
    )
    fleet_lost.add_sample("penstock_fleet_lost_requests_total", {}, lost_in_all)
    for name, load in sorted(loads.items()):
        labels = {REPLICA_LABEL: name}
        requests.add_sample("penstock_fleet_replica_requests_total", labels, load.served)
        running.add_sample("penstock_fleet_replica_running_requests", labels, load.running)
        tokens.add_sample("penstock_fleet_replica_output_tokens_total", labels, load.tokens)
        lost.add_sample("penstock_fleet_replica_lost_requests_total", labels, load.lost)
    for name in sorted(answered):
        up.add_sample("penstock_fleet_replica_up", {REPLICA_LABEL: name}, 1)
    return [requests, running, tokens, lost, up, fleet_lost]


def labelled_families(texts: Mapping[str, str]) -> list[Metric]:
    """Every replica's families (``texts``: replica name to its exposition text), each
    series labelled with its replica, one family per name."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                target.add_sample(
                    sample.name,
                    {**sample.labels, REPLICA_LABEL: replica},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
    return list(merged.values())


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(families: list[Metric]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return generate_latest(registry).decode()
