"""The fleet's count of requests lost to a replica's death outlives the replica."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from penstock.ray.fleet import ReplicaLoad
from penstock.ray.metrics import fleet_families, render


def samples(loads: dict[str, ReplicaLoad], lost_in_all: int) -> dict[str, float]:
    text = render(fleet_families(loads, loads, lost_in_all))
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_losses_of_a_replica_that_left_are_still_counted() -> None:
    live = {"replica-b": ReplicaLoad(served=3, lost=1)}
    seen = samples(live, lost_in_all=5)
    assert seen["penstock_fleet_lost_requests_total[]"] == 5
    assert seen["penstock_fleet_replica_lost_requests_total[('replica', 'replica-b')]"] == 1
    assert not any("replica-a" in name for name in seen)


def test_a_fleet_that_lost_nothing_says_zero() -> None:
    assert samples({}, lost_in_all=0)["penstock_fleet_lost_requests_total[]"] == 0
