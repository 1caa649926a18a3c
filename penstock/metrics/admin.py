"""The RL admin plane's metrics: state, weight version, operation durations, failures.

The state and the weight version are read at scrape time from callables the gateway
gives (:meth:`AdminMetrics.watch`), so they never disagree with ``/engine/state``. Every
label value comes from a fixed list or from the engine's own update names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import InfoMetricFamily
from prometheus_client.registry import Collector

from penstock.metrics.frontend import NO_WEIGHT_VERSION

ADMIN_STATES = ("serving", "paused", "sleeping", "updating", "draining")
ADMIN_OPERATIONS = ("pause", "resume", "sleep", "wake_up")
ABORTING_OPERATIONS = ("pause", "sleep", "abort_request")
FAILURE_REASONS = ("rejected", "timeout", "error")

_OPERATION_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600]


class _VersionInfo(Collector):
    def __init__(self, version: Callable[[], str | None]) -> None:
        self._version = version

    def collect(self) -> Iterable[InfoMetricFamily]:
        yield InfoMetricFamily(
            "penstock_weight_version",
            "The weight version being served",
            value={"weight_version": self._version() or NO_WEIGHT_VERSION},
        )


class AdminMetrics:
    """Families of the admin plane, in the gateway's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.state = Gauge(
            "penstock_admin_state",
            "1 for the current admin state, 0 for the others",
            ["state"],
            registry=registry,
        )
        self.operation_duration = Histogram(
            "penstock_admin_operation_duration_seconds",
            "Duration of admin operations that changed the state",
            ["operation"],
            buckets=_OPERATION_BUCKETS,
            registry=registry,
        )
        self.aborted = Counter(
            "penstock_admin_aborted_requests",
            "Requests the engine ended because of an admin operation",
            ["operation"],
            registry=registry,
        )
        self.version_changes = Counter(
            "penstock_weight_version_changes",
            "Times the served weight version changed",
            registry=registry,
        )
        self.update_duration = Histogram(
            "penstock_weight_update_duration_seconds",
            "Duration of successful weight updates",
            ["method"],
            buckets=_OPERATION_BUCKETS,
            registry=registry,
        )
        self.update_failures = Counter(
            "penstock_weight_update_failures",
            "Weight updates that failed",
            ["method", "reason"],
            registry=registry,
        )
        self._operations = {name: self.operation_duration.labels(name) for name in ADMIN_OPERATIONS}
        self._aborted = {name: self.aborted.labels(name) for name in ABORTING_OPERATIONS}

    def watch(self, state: Callable[[], str], version: Callable[[], str | None]) -> None:
        """Read the admin state and the weight version from these at every scrape."""
        for name in ADMIN_STATES:
            self.state.labels(name).set_function(lambda name=name: float(state() == name))
        self._registry.register(_VersionInfo(version))

    def operation_done(self, operation: str, seconds: float) -> None:
        self._operations[operation].observe(seconds)

    def requests_aborted(self, operation: str, count: int) -> None:
        if count > 0:
            self._aborted[operation].inc(count)

    def version_changed(self) -> None:
        self.version_changes.inc()

    def update_done(self, method: str, seconds: float) -> None:
        self.update_duration.labels(method).observe(seconds)

    def update_failed(self, method: str, reason: str) -> None:
        self.update_failures.labels(method, reason).inc()
