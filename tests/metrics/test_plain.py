"""Plain children, folded when collected, expose what prometheus_client's own would."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest

from penstock.metrics.plain import PlainFamilies

BUCKETS = (0.01, 0.1, 1.0, 10.0)
LABELS = ["a", "b"]

amounts = st.floats(min_value=0, max_value=100, allow_nan=False)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("counter"), st.sampled_from(LABELS), amounts),
        st.tuples(st.just("gauge_inc"), st.sampled_from(LABELS), amounts),
        st.tuples(st.just("gauge_dec"), st.sampled_from(LABELS), amounts),
        st.tuples(st.just("summary"), st.sampled_from(LABELS), amounts),
        st.tuples(st.just("histogram"), st.sampled_from(LABELS), amounts),
        st.tuples(st.just("histogram_many"), st.sampled_from(LABELS), st.lists(amounts)),
        st.tuples(st.just("unlabelled"), st.just(""), amounts),
        st.tuples(st.just("collect"), st.just(""), st.just(0.0)),
    ),
    max_size=60,
)


def _prometheus(registry: CollectorRegistry) -> dict[str, Any]:
    return {
        "counter": Counter("jobs", "Jobs", ["kind"], registry=registry),
        "gauge": Gauge("running", "Running", ["kind"], registry=registry),
        "summary": Summary("size_bytes", "Sizes", ["kind"], registry=registry),
        "histogram": Histogram(
            "wait_seconds", "Waits", ["kind"], buckets=BUCKETS, registry=registry
        ),
        "unlabelled": Histogram("all_seconds", "All", buckets=BUCKETS, registry=registry),
    }


def _plain(registry: CollectorRegistry) -> dict[str, Any]:
    families = PlainFamilies()
    made = {
        "counter": families.counter("jobs", "Jobs", ["kind"]),
        "gauge": families.gauge("running", "Running", ["kind"]),
        "summary": families.summary("size_bytes", "Sizes", ["kind"]),
        "histogram": families.histogram("wait_seconds", "Waits", ["kind"], buckets=BUCKETS),
        "unlabelled": families.histogram("all_seconds", "All", buckets=BUCKETS),
    }
    registry.register(families)
    return made


def _samples(registry: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]], float]]:
    return sorted(
        (sample.name, sorted(sample.labels.items()), sample.value)
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    )


def _apply(families: dict[str, Any], operation: tuple[str, str, Any], plain: bool) -> None:
    name, label, amount = operation
    if name == "unlabelled":
        child = families["unlabelled"].labels() if plain else families["unlabelled"]
        child.observe(amount)
        return
    family = families[name.split("_")[0]]
    child = family.labels(label)
    if name == "counter":
        child.inc(amount)
    elif name == "gauge_inc":
        child.inc(amount)
    elif name == "gauge_dec":
        child.dec(amount)
    elif name in ("summary", "histogram"):
        child.observe(amount)
    elif plain:
        child.observe_many(amount)
    else:
        for one in amount:
            child.observe(one)


@settings(max_examples=200, deadline=None)
@given(operations=operations)
def test_the_exposition_is_prometheus_clients_whenever_it_is_collected(
    operations: list[tuple[str, str, Any]],
) -> None:
    own, plain = CollectorRegistry(), CollectorRegistry()
    own_families, plain_families = _prometheus(own), _plain(plain)
    for operation in operations:
        if operation[0] == "collect":
            _assert_same(_samples(plain), _samples(own))
            continue
        _apply(own_families, operation, plain=False)
        _apply(plain_families, operation, plain=True)
    _assert_same(_samples(plain), _samples(own))
    _assert_same(_samples(plain), _samples(own))


def _assert_same(got: list[Any], expected: list[Any]) -> None:
    # Sums are added up in another order: equal but for the last bits.
    assert [sample[:2] for sample in got] == [sample[:2] for sample in expected]
    assert [sample[2] for sample in got] == pytest.approx([sample[2] for sample in expected])


def test_the_text_format_is_the_same_but_for_creation_times() -> None:
    own, plain = CollectorRegistry(), CollectorRegistry()
    own_families, plain_families = _prometheus(own), _plain(plain)
    for families, is_plain in ((own_families, False), (plain_families, True)):
        for operation in [("counter", "a", 2), ("histogram", "b", 0.5), ("summary", "a", 7)]:
            _apply(families, operation, plain=is_plain)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return sorted(line for line in text.splitlines() if "_created" not in line)

    assert lines(plain) == lines(own)


def test_a_child_is_created_when_first_used_and_a_name_taken_twice_is_refused() -> None:
    registry = CollectorRegistry()
    families = PlainFamilies()
    jobs = families.counter("jobs", "Jobs", ["kind"])
    registry.register(families)
    assert registry.get_sample_value("jobs_total", {"kind": "a"}) is None
    jobs.labels("a").inc()
    assert registry.get_sample_value("jobs_total", {"kind": "a"}) == 1
    assert registry.get_sample_value("jobs_created", {"kind": "a"}) is not None
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("jobs", "Again", registry=registry)


def test_collections_on_other_threads_miss_nothing() -> None:
    registry = CollectorRegistry()
    families = PlainFamilies()
    jobs = families.counter("jobs", "Jobs")
    waits = families.histogram("wait_seconds", "Waits", buckets=BUCKETS)
    registry.register(families)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            registry.collect()
            list(registry.collect())

    scrapers = [threading.Thread(target=scrape) for _ in range(2)]
    for scraper in scrapers:
        scraper.start()
    try:
        for _ in range(20_000):
            jobs.labels().inc()
            waits.labels().observe(0.5)
    finally:
        stop.set()
        for scraper in scrapers:
            scraper.join()
    assert registry.get_sample_value("jobs_total") == 20_000
    assert registry.get_sample_value("wait_seconds_count") == 20_000
    assert registry.get_sample_value("wait_seconds_sum") == pytest.approx(10_000)
