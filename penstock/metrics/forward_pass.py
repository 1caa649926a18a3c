"""Per-forward-pass scheduler metrics and per-rank KV snapshots an engine publishes.

A ``ForwardPassMetrics`` record describes one scheduler iteration: what ran (prefill and
decode requests, token sums, length variances) and what waited. An engine emits one per
non-empty forward pass and a single all-zero heartbeat (``wall_time == 0``) when it goes
from active to idle, so a consumer can tell "idle" from "silent". Records travel as
msgpack.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

logger = logging.getLogger(__name__)

FPM_VERSION = 1


class ScheduledRequestMetrics(msgspec.Struct, frozen=True):
    """Requests scheduled in this iteration.

    ``sum_prefill_tokens`` counts tokens computed this step; ``var_prefill_length`` is the
    population variance of the full prompt lengths; the ``*_kv_tokens`` fields count tokens
    read back from the KV cache.
    """

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True):
    """Requests waiting in the queue (not scheduled this iteration); raw token totals."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class ForwardPassMetrics(msgspec.Struct, frozen=True):
    """One scheduler iteration; ``wall_time`` is 0.0 only for the idle heartbeat."""

    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()

    @property
    def is_heartbeat(self) -> bool:
        return self.wall_time == 0.0


class WelfordAccumulator:
    """Running count, sum and population variance in one pass (Welford's algorithm)."""

    __slots__ = ("_m2", "_mean", "n", "s")

    def __init__(self) -> None:
        self.n = 0
        self.s = 0
        self._mean = 0.0
        self._m2 = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.s += value
        delta = value - self._mean
        self._mean += delta / self.n
        self._m2 += delta * (value - self._mean)

    def variance(self) -> float:
        """Population variance; 0.0 when nothing was added."""
        return self._m2 / self.n if self.n else 0.0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)


def forward_pass_from(
    worker_id: str,
    counter_id: int,
    wall_time: float,
    prefill: WelfordAccumulator,
    decode: WelfordAccumulator,
    waiting: WelfordAccumulator,
    preempted: int = 0,
) -> ForwardPassMetrics:
    """One pass's metrics from its accumulated prompt lengths, decode KV tokens and
    waiting prompts; ``preempted``: requests waiting to resume decoding."""
    return ForwardPassMetrics(
        worker_id=worker_id,
        counter_id=counter_id,
        wall_time=wall_time,
        scheduled_requests=ScheduledRequestMetrics(
            num_prefill_requests=prefill.n,
            sum_prefill_tokens=int(prefill.s),
            var_prefill_length=prefill.variance(),
            num_decode_requests=decode.n,
            sum_decode_kv_tokens=int(decode.s),
            var_decode_kv_tokens=decode.variance(),
        ),
        queued_requests=QueuedRequestMetrics(
            num_prefill_requests=waiting.n,
            sum_prefill_tokens=int(waiting.s),
            var_prefill_length=waiting.variance(),
            num_decode_requests=preempted,
        ),
    )


def encode(metrics: ForwardPassMetrics) -> bytes:
    return _encoder.encode(metrics)


def decode(data: bytes) -> ForwardPassMetrics | None:
    """Decode one record; None (with a warning) for bad bytes or another version."""
    try:
        metrics = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        logger.warning("dropping undecodable forward-pass metrics: %s", exc)
        return None
    if metrics.version != FPM_VERSION:
        logger.warning("dropping forward-pass metrics of version %s", metrics.version)
        return None
    return metrics


@dataclass(frozen=True)
class ComponentSnapshot:
    """KV occupancy of one data-parallel rank.

    ``kv_cache_hit_rate`` is tri-state: None means no data (or no prefix cache) and the
    gauge is not written; 0.0 is a real measurement.
    """

    kv_used_blocks: int
    kv_total_blocks: int
    gpu_cache_usage: float
    dp_rank: int
    kv_cache_hit_rate: float | None = None
