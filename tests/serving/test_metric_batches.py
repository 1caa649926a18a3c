"""Per-token observations recorded in batches give the same histogram as one at a time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from penstock.metrics.frontend import observe_many


def _samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]


def test_observe_many_matches_observe_one_by_one() -> None:
    # Values on the bucket bounds, between them, below the first and above the last.
    amounts = [0.001, 0.01, 0.1, 1.0, 0.0005, 0.05, 0.5, 2.0, 0.25, 0.01] * 7
    one, many = CollectorRegistry(), CollectorRegistry()
    bounds = [0.001, 0.01, 0.1, 1.0]
    single = Histogram("itl", "x", ["model"], buckets=bounds, registry=one).labels("m")
    batched = Histogram("itl", "x", ["model"], buckets=bounds, registry=many).labels("m")
    for amount in amounts:
        single.observe(amount)
    observe_many(batched, amounts[:40])
    observe_many(batched, [])
    observe_many(batched, amounts[40:])
    expected, got = _samples(one), _samples(many)
    assert [s[:2] for s in got] == [s[:2] for s in expected]
    for (_, _, want), (_, _, have) in zip(expected, got, strict=True):
        assert abs(have - want) < 1e-9
