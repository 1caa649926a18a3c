"""Forward-pass records, KV snapshots and Prometheus gauges of the transformers engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from penstock.engines.transformers import TransformersEngine
from penstock.metrics.forward_pass import (
    ComponentSnapshot,
    ForwardPassMetrics,
    ScheduledRequestMetrics,
    WelfordAccumulator,
    decode,
    encode,
)
from tests.engines.transformers.helpers import PROMPT, greedy, run


class RecordingPublisher:
    """Stands in for the gateway's snapshot publisher; records what the engine publishes."""

    def __init__(self) -> None:
        self.snapshots: list[tuple[int, ComponentSnapshot]] = []
        self.passes: list[ForwardPassMetrics] = []
        self.threads: set[str] = set()

    def publish_forward_pass(self, metrics: ForwardPassMetrics) -> None:
        self.passes.append(metrics)

    def publish(self, rank: int, snapshot: ComponentSnapshot) -> None:
        self.snapshots.append((rank, snapshot))
        self.threads.add(threading.current_thread().name)


class RecordingMetrics:
    """Stands in for the gateway's metrics handle: keeps the registered callbacks."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_expfmt_callback(self, callback) -> None:
        self.callbacks.append(callback)


async def _wait_for_heartbeat(engine: TransformersEngine) -> None:
    # The engine writes records from its own thread; there is no event to await.
    async with asyncio.timeout(5):
        while not (  # noqa: ASYNC110
            engine.latest_forward_pass_metrics and engine.latest_forward_pass_metrics.is_heartbeat
        ):
            await asyncio.sleep(0.01)


async def test_one_record_per_forward_pass_then_an_idle_heartbeat(
    engine: TransformersEngine,
) -> None:
    engine.forward_pass_metrics.clear()
    await run(engine, greedy(max_tokens=5))
    await _wait_for_heartbeat(engine)
    records = list(engine.forward_pass_metrics)
    passes, heartbeat = records[:-1], records[-1]
    assert len(passes) == 5, "a prefill step, then four decode steps"
    prefill = passes[0].scheduled_requests
    assert (prefill.num_prefill_requests, prefill.sum_prefill_tokens) == (1, len(PROMPT))
    assert prefill.num_decode_requests == 0
    for i, record in enumerate(passes[1:], start=1):
        scheduled = record.scheduled_requests
        assert scheduled.num_decode_requests == 1
        assert scheduled.sum_decode_kv_tokens == len(PROMPT) + i
        assert record.wall_time > 0
    counters = [record.counter_id for record in records]
    assert counters == sorted(set(counters))
    assert heartbeat.wall_time == 0.0
    assert heartbeat.scheduled_requests == ScheduledRequestMetrics()
    assert heartbeat.worker_id == passes[0].worker_id == "7"


async def test_queued_requests_are_counted(tiny_model_dir) -> None:
    from tests.engines.transformers.conftest import start_engine

    engine = await start_engine(tiny_model_dir, "--max-num-seqs", "1")
    try:
        await asyncio.gather(*(run(engine, greedy(max_tokens=4)) for _ in range(3)))
        queued = [r.queued_requests.num_prefill_requests for r in engine.forward_pass_metrics]
        assert max(queued) == 2
        assert max(r.queued_requests.sum_prefill_tokens for r in engine.forward_pass_metrics) == (
            2 * len(PROMPT)
        )
    finally:
        await engine.cleanup()


async def test_snapshots_report_kv_blocks_for_rank_zero(engine: TransformersEngine) -> None:
    assert engine.component_metrics_dp_ranks() == [0]
    publisher = RecordingPublisher()
    engine.attach_snapshot_publisher(publisher)
    await run(engine, greedy(prompt=list(range(3, 40)), max_tokens=4))
    await _wait_for_heartbeat(engine)
    ranks = {rank for rank, _ in publisher.snapshots}
    assert ranks == {0}
    busy = [s for _, s in publisher.snapshots if s.kv_used_blocks]
    assert busy, "KV was in use while the request ran"
    assert all(s.kv_total_blocks == engine.scheduler.kv_total_blocks for s in busy)
    assert all(0 < s.gpu_cache_usage <= 1 and s.kv_cache_hit_rate is None for s in busy)
    assert publisher.snapshots[-1][1].kv_used_blocks == 0
    assert publisher.threads == {"penstock-batch"}
    assert len(publisher.passes) == len(publisher.snapshots), "one pass per snapshot"
    assert publisher.passes[-1].is_heartbeat


async def test_prometheus_gauges(engine: TransformersEngine) -> None:
    metrics = RecordingMetrics()
    await engine.register_prometheus(metrics)
    (callback,) = metrics.callbacks
    text = callback()
    blocks = engine.scheduler.kv_total_blocks
    assert f'penstock_engine_kv_total_blocks{{model="{engine.served_model_name}"}} {blocks}' in (
        text
    )
    for name in ("kv_used_blocks", "num_running", "num_waiting", "memory_bytes"):
        assert f"# TYPE penstock_engine_{name} gauge" in text
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    label = f'model="{engine.served_model_name}",kind="weights"'
    assert f"penstock_engine_memory_bytes{{{label}}} {weights}" in text
    await engine.register_prometheus(object())


def test_records_round_trip_through_msgpack() -> None:
    record = ForwardPassMetrics(
        worker_id="w",
        counter_id=3,
        wall_time=0.25,
        scheduled_requests=ScheduledRequestMetrics(num_decode_requests=2, sum_decode_kv_tokens=9),
    )
    assert decode(encode(record)) == record
    assert decode(b"\x00garbage") is None
    assert decode(encode(ForwardPassMetrics(version=2))) is None


def test_welford_variance_is_the_population_variance() -> None:
    accumulator = WelfordAccumulator()
    assert accumulator.variance() == 0.0
    for value in (2, 4, 4, 4, 5, 5, 7, 9):
        accumulator.add(value)
    assert (accumulator.n, accumulator.s) == (8, 40)
    assert accumulator.variance() == pytest.approx(4.0)
