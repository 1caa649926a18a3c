"""Media generation metrics: video jobs by status, the worker queue, durations, steps.

Job counts and queue sizes are read at scrape time from callables the media service
gives (:meth:`MediaMetrics.watch`): the job store outlives the process, so a counter
kept in memory would not match it after a restart. A job store that is slow or away
gives the counts it gave last rather than holding the scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

JOB_STATUSES = ("queued", "in_progress", "completed", "failed")


class _JobCounts(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "penstock_media_jobs", "Video jobs in the job store by status", labels=["status"]
        )
        try:
            counts = self._counts()
        except Exception:
            # A closed store (shutdown) must not turn the whole scrape into a 500.
            logger.exception("could not count the video jobs")
            counts = {}
        for status in JOB_STATUSES:
            family.add_metric([status], counts.get(status, 0))
        yield family


class MediaMetrics:
    """Families of the media service, in the gateway's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        # No counts until a job store is watched: a server without one has no jobs.
        self._jobs = _JobCounts(dict)
        registry.register(self._jobs)
        self.queue_depth = Gauge(
            "penstock_media_queue_depth",
            "Generations waiting for a media worker",
            registry=registry,
        )
        self.running = Gauge(
            "penstock_media_running_generations",
            "Generations running on a media worker",
            registry=registry,
        )
        self.job_duration = Histogram(
            "penstock_media_job_duration_seconds",
            "Time from a worker starting a generation to its end",
            ["model", "kind", "status"],
            buckets=[0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600],
            registry=registry,
        )
        self.step_time = Histogram(
            "penstock_media_denoising_step_seconds",
            "Time per denoising step",
            ["model"],
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
            registry=registry,
        )

    def watch(
        self,
        job_counts: Callable[[], Mapping[str, int]],
        queue_depth: Callable[[], int],
        running: Callable[[], int],
    ) -> None:
        """Read job counts and the pool's sizes from these at every scrape."""
        self._registry.unregister(self._jobs)
        self._jobs = _JobCounts(job_counts)
        self._registry.register(self._jobs)
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)

    def generation_done(self, model: str, kind: str, status: str, seconds: float) -> None:
        self.job_duration.labels(model, kind, status).observe(seconds)

    def steps_done(self, model: str, steps: int, seconds: float) -> None:
        """``steps`` denoising steps took ``seconds`` together."""
        if steps > 0:
            self.step_time.labels(model).observe(seconds / steps)
