"""What the batch scheduler reports: its KV pool's state (and the Prometheus lines of
its prefix cache), and each step's forward-pass metrics."""

from __future__ import annotations

from dataclasses import dataclass

from penstock.engines.transformers.core.sequence import Sequence, Submission
from penstock.metrics.forward_pass import (
    ForwardPassMetrics,
    WelfordAccumulator,
    forward_pass_from,
)


@dataclass(frozen=True)
class KvUsage:
    used_blocks: int
    total_blocks: int
    running: int
    waiting: int
    cached_blocks: int = 0
    # Since start: prompt tokens computed, and prompt tokens taken from the prefix cache.
    prefill_tokens: int = 0
    cached_tokens: int = 0
    # Since start: requests preempted for lack of free blocks.
    preemptions: int = 0


def prefix_cache_lines(usage: KvUsage, label: str) -> list[str]:
    """The prefix cache's gauge and counters in the Prometheus text format, for the model
    labelled ``label`` (already escaped)."""
    families = (
        (
            "penstock_engine_kv_cached_blocks",
            "gauge",
            "KV blocks a prompt can match",
            usage.cached_blocks,
        ),
        (
            "penstock_engine_prefill_tokens_total",
            "counter",
            "Prompt tokens computed",
            usage.prefill_tokens,
        ),
        (
            "penstock_engine_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens taken from the prefix cache",
            usage.cached_tokens,
        ),
        (
            "penstock_engine_preemptions_total",
            "counter",
            "Requests preempted for lack of KV blocks",
            usage.preemptions,
        ),
    )
    lines = []
    for name, kind, help_text, value in families:
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} {kind}",
            f'{name}{{model="{label}"}} {value}',
        ]
    return lines


def step_metrics(
    worker_id: str,
    counter: int,
    wall_time: float,
    admitted: list[Submission],
    decoded: list[Sequence],
    queued: list[Submission],
) -> ForwardPassMetrics:
    """One step's metrics; a queued request that was preempted counts as a decode
    request waiting to resume."""
    prefill = WelfordAccumulator()
    for submission in admitted:
        prefill.add(len(submission.prompt_ids))
    decode = WelfordAccumulator()
    for seq in decoded:
        decode.add(seq.kv_length)
    waiting = WelfordAccumulator()
    preempted = 0
    for submission in queued:
        if submission.sequences:
            preempted += 1
        else:
            waiting.add(len(submission.prompt_ids))
    return forward_pass_from(
        worker_id, counter, max(wall_time, 1e-9), prefill, decode, waiting, preempted
    )
