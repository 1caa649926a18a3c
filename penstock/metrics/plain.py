"""Metric children updated with plain arithmetic, folded into prometheus_client when read.

Every request updates a score of series (the HTTP families, the frontend's per-model
ones). A prometheus_client update takes a lock and checks its arguments, about a
microsecond for a histogram; over a short request that is ~15 µs of its CPU
(bench/README.md, "Metrics folded at collection"). The series a request updates are
changed by the event loop alone, so :class:`PlainFamilies` hands out children that add
to Python numbers, and folds what they gathered into real prometheus_client families
each time its registry is collected. The exposition is prometheus_client's own.

A plain histogram may count in finer buckets than its family shows (``finer``): another
view of the same observations with other bounds (:mod:`penstock.metrics.vllm`) is then
read off its counts exactly, with no second observation.

Guarantees: children are updated from one thread (the event loop); collection may run
on any thread, and sees every update made before it began.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, Summary
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector


class PlainCounter:
    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0.0

    def inc(self, amount: float = 1) -> None:
        self.total += amount


class PlainGauge:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount


class PlainSummary:
    """A summary without quantiles, as prometheus_client's: a count and a sum."""

    __slots__ = ("count", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.count += 1
        self.sum += amount


class PlainHistogram:
    __slots__ = ("bounds", "counts", "shown", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        # The upper bounds, +Inf last; ``counts[i]`` is what fell in bucket i alone.
        self.bounds = list(bounds)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        # The family's bucket of each of these (the same index unless it counts finer).
        self.shown = list(range(len(self.bounds)))

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect_left(self.bounds, amount)] += 1

    def observe_many(self, amounts: Sequence[float]) -> None:
        counts = self.counts
        # The bucket search and the sum in C: this runs for a stream's every token.
        for index in map(bisect_left, repeat(self.bounds, len(amounts)), amounts):
            counts[index] += 1
        self.sum += sum(amounts)


PlainChild = PlainCounter | PlainGauge | PlainSummary | PlainHistogram


class PlainFamily:
    """One family: its children by label values, each with its prometheus_client child."""

    def __init__(
        self, owner: PlainFamilies, metric: MetricWrapperBase, finer: tuple[float, ...] = ()
    ) -> None:
        self._owner = owner
        self.metric = metric
        self._finer = finer
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        """The child for ``values`` (none for a family without labels)."""
        child = self._children.get(values)
        if child is None:
            # The prometheus_client child exists from the first use, so its ``_created``
            # is the plain child's.
            target = self.metric.labels(*values) if values else self.metric
            child = self._owner._add_child(target, self._finer)
            self._children[values] = child
        return child

    def children(self) -> list[tuple[tuple[str, ...], Any]]:
        """Each child with its label values, as of now (read from any thread)."""
        return list(self._children.items())


class PlainFamilies(Collector):
    """Families whose children are plain, collected as one: declare the families, then
    ``registry.register`` this (the prometheus_client families behind it are in no
    registry of their own)."""

    def __init__(self) -> None:
        self._families: list[MetricWrapperBase] = []
        # (plain child, prometheus_client child, what was folded into it so far)
        self._folds: list[tuple[Any, Any, list[float]]] = []
        self._lock = threading.Lock()

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> PlainFamily:
        return self._family(Counter(name, documentation, labelnames, registry=None))

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> PlainFamily:
        return self._family(Gauge(name, documentation, labelnames, registry=None))

    def summary(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> PlainFamily:
        return self._family(Summary(name, documentation, labelnames, registry=None))

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        finer: Sequence[float] = (),
    ) -> PlainFamily:
        """``finer``: bounds the children count at too, beside ``buckets``."""
        metric = Histogram(name, documentation, labelnames, buckets=buckets, registry=None)
        return self._family(metric, tuple(finer))

    def _family(self, metric: MetricWrapperBase, finer: tuple[float, ...] = ()) -> PlainFamily:
        self._families.append(metric)
        return PlainFamily(self, metric, finer)

    def _add_child(self, target: Any, finer: tuple[float, ...]) -> PlainChild:
        child: PlainChild
        if isinstance(target, Histogram):
            shown = target._upper_bounds
            child = PlainHistogram(sorted({*shown, *finer}))
            # Per counted bucket, the shown bucket it falls in.
            child.shown = [bisect_left(shown, bound) for bound in child.bounds]
            folded = [0.0] * (len(child.bounds) + 1)
        elif isinstance(target, Summary):
            child = PlainSummary()
            folded = [0.0, 0.0]
        elif isinstance(target, Gauge):
            child = PlainGauge()
            folded = []
        else:
            child = PlainCounter()
            folded = [0.0]
        with self._lock:
            self._folds.append((child, target, folded))
        return child

    def describe(self) -> list[Any]:
        return [family for metric in self._families for family in metric.describe()]

    def collect(self) -> Iterator[Any]:
        with self._lock:
            for child, target, folded in self._folds:
                _fold(child, target, folded)
        for metric in self._families:
            yield from metric.collect()


def _fold(child: PlainChild, target: Any, folded: list[float]) -> None:
    """Add to ``target`` what ``child`` gathered since the last fold."""
    if isinstance(child, PlainHistogram):
        # ``folded`` holds each bucket's count, then the sum.
        counts = list(child.counts)
        total = child.sum
        shown = child.shown
        for bucket, count in enumerate(counts):
            if count != folded[bucket]:
                target._buckets[shown[bucket]].inc(count - folded[bucket])
                folded[bucket] = count
        if total != folded[-1]:
            target._sum.inc(total - folded[-1])
            folded[-1] = total
    elif isinstance(child, PlainSummary):
        count, total = child.count, child.sum
        if count != folded[0]:
            target._count.inc(count - folded[0])
            target._sum.inc(total - folded[1])
            folded[0], folded[1] = count, total
    elif isinstance(child, PlainGauge):
        target.set(child.value)
    else:
        total = child.total
        if total != folded[0]:
            target.inc(total - folded[0])
            folded[0] = total
