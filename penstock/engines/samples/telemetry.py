"""The sample engine's telemetry: a bounded prefix cache with its KV events, and one
simulated forward pass (with a KV snapshot) per interval while requests run.

Every ``max(--delay, 10 ms)`` the requests that got their first token are the prefills,
those that advanced the decodes, those held by a pause the queued ones; then one idle
heartbeat. Each new prompt is a cached prefix (a KV stored event) of 16-token blocks out
of 1000; prefixes fill at most those blocks, the least recently used leaving with a
removed event, and a weight update, flush or KV sleep clears them (one cleared event).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from penstock.engines.contract import PushSource
from penstock.metrics.forward_pass import (
    ComponentSnapshot,
    ForwardPassMetrics,
    WelfordAccumulator,
    forward_pass_from,
)

if TYPE_CHECKING:
    from penstock.engines.samples.controls import Flight

KV_BLOCK_SIZE = 16
TOTAL_KV_BLOCKS = 1000
MIN_PASS_INTERVAL_S = 0.01


class PrefixCache:
    """The prompts whose blocks the engine holds, by the prompt's hash: the least recently
    used leave once they would fill more than ``total_blocks`` (as a real engine's KV
    cache is bounded, and so that distinct prompts don't grow the process)."""

    __slots__ = ("_blocks", "_held", "total_blocks")

    def __init__(self, total_blocks: int) -> None:
        self.total_blocks = total_blocks
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    @property
    def held_blocks(self) -> int:
        return self._held

    def touch(self, key: int) -> bool:
        """Whether ``key`` is cached (a hit makes it the most recently used)."""
        if key not in self._blocks:
            return False
        self._blocks.move_to_end(key)
        return True

    def add(self, key: int, blocks: int) -> list[tuple[int, int]]:
        """Cache ``key``'s ``blocks``; returns the (key, blocks) that left for room."""
        evicted: list[tuple[int, int]] = []
        while self._blocks and self._held + blocks > self.total_blocks:
            old = self._blocks.popitem(last=False)
            self._held -= old[1]
            evicted.append(old)
        self._blocks[key] = blocks
        self._held += blocks
        return evicted

    def clear(self) -> None:
        self._blocks.clear()
        self._held = 0


class SampleTelemetry:
    """Prefix cache, KV events and forward passes of the sample engine (mixed into it)."""

    delay: float
    _flights: set[Flight]

    def __init__(self) -> None:
        self.prefix_cache = PrefixCache(TOTAL_KV_BLOCKS)
        self._publisher: Any = None
        self._kv_events: Any = None
        self._active = asyncio.Event()
        self._pass_counter = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._publisher = publisher

    async def kv_event_sources(self) -> list[Any]:
        return [PushSource(on_ready=self._kv_ready, dp_rank=0)]

    def _kv_ready(self, publisher: Any) -> None:
        self._kv_events = publisher

    def _note_prompt(self, prompt: list[int]) -> None:
        """A prompt arrived: a prefix cache hit, or a new prefix (stored, maybe evicting)."""
        self._active.set()
        key = hash(tuple(prompt))
        self._prefix_queries += 1
        if self.prefix_cache.touch(key):
            self._prefix_hits += 1
            return
        blocks = max(1, len(prompt) // KV_BLOCK_SIZE)
        self._publish_stored(key, blocks)
        for old_key, old_blocks in self.prefix_cache.add(key, blocks):
            self._publish_removed(old_key, old_blocks)

    def _clear_prefix_cache(self) -> int:
        """Empty the prefix cache (one cleared event); returns how many prompts it held."""
        held = len(self.prefix_cache)
        self.prefix_cache.clear()
        if self._kv_events is not None:
            self._kv_events.clear_all()
        return held

    def _publish_stored(self, key: int, blocks: int) -> None:
        """A new prompt prefix is cached: one stored event for its whole blocks."""
        if self._kv_events is None:
            return
        self._kv_events.publish_stored(
            token_ids=[],
            num_block_tokens=[KV_BLOCK_SIZE] * blocks,
            block_hashes=[hash((key, i)) for i in range(blocks)],
        )

    def _publish_removed(self, key: int, blocks: int) -> None:
        """A prompt prefix left the cache: one removed event for its blocks."""
        if self._kv_events is not None:
            self._kv_events.publish_removed([hash((key, i)) for i in range(blocks)])

    async def _report_passes(self) -> None:
        """One simulated forward pass per interval while requests run, then a heartbeat."""
        loop = asyncio.get_running_loop()
        interval = max(self.delay, MIN_PASS_INTERVAL_S)
        was_active = False
        while True:
            if not self._flights:
                if was_active:
                    self._publish_pass(0.0)
                    was_active = False
                self._active.clear()
                await self._active.wait()
            was_active = True
            started = loop.time()
            await asyncio.sleep(interval)
            self._publish_pass(loop.time() - started)

    def _publish_pass(self, wall_time: float) -> None:
        """Publish what ran since the previous pass; ``wall_time`` 0 is the heartbeat."""
        publisher = self._publisher
        if publisher is None:
            return
        prefill, decode, waiting = WelfordAccumulator(), WelfordAccumulator(), WelfordAccumulator()
        preempted, used_blocks = 0, 0
        for flight in self._flights:
            if not flight.admitted:
                waiting.add(flight.prompt_tokens)
                continue
            kv_tokens = flight.prompt_tokens + flight.generated
            used_blocks += math.ceil(kv_tokens / KV_BLOCK_SIZE)
            if flight.generated == flight.reported:
                preempted += flight.generated > 0
            elif flight.reported == 0:
                prefill.add(flight.prompt_tokens)
            else:
                decode.add(kv_tokens)
            flight.reported = flight.generated
        self._pass_counter += 1
        if wall_time == 0.0:
            metrics = ForwardPassMetrics(worker_id="sample", counter_id=self._pass_counter)
        else:
            metrics = forward_pass_from(
                "sample", self._pass_counter, wall_time, prefill, decode, waiting, preempted
            )
        publish_forward_pass = getattr(publisher, "publish_forward_pass", None)
        if publish_forward_pass is not None:
            publish_forward_pass(metrics)
        publisher.publish(
            0,
            ComponentSnapshot(
                kv_used_blocks=used_blocks,
                kv_total_blocks=TOTAL_KV_BLOCKS,
                gpu_cache_usage=used_blocks / TOTAL_KV_BLOCKS,
                dp_rank=0,
                kv_cache_hit_rate=(
                    self._prefix_hits / self._prefix_queries if self._prefix_queries else None
                ),
            ),
        )
