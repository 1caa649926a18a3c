"""Continuous batching over a Hugging Face causal LM, on one dedicated thread.

Why a scheduler of our own: transformers' ``ContinuousBatchingManager`` fixes its sampling
setup per manager and has no per-request seed, min-p, penalties, min_tokens, top logprobs
or ``n``; this one keeps the model's own forward and adds what a server needs around it.

This module holds admission, batch composition and the step loop; :mod:`.sequence`,
:mod:`.block_manager`, :mod:`.prefill_plan` and :mod:`.model_runner` the rest (see
DESIGN.md). The batch changes only at step boundaries: requests admitted in a step are
prefilled within its token budget (``step_tokens``, decode rows included) and join the
running rows, which decode one token per step until they finish or are cancelled.

KV lives in blocks of the pool (``kv_capacity_tokens``, :mod:`.kv_cache`): a request is
admitted when the pool has the blocks its prompt needs, and a running row takes a block
each time its tokens fill the last one, never ``max_tokens`` ahead. A row finding the pool
empty preempts the request that runs last in admission order (lowest ``priority``, then
latest arrival): its blocks are freed and it waits again with its tokens, recomputed
(from its cached blocks on) when admitted back. Cached leading blocks are not computed.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from penstock.engines.transformers.core.block_manager import BLOCK_SIZE, BlockManager, KvEventRelay
from penstock.engines.transformers.core.chunk_pacing import UNPACED_CPU_CHUNK, ChunkPacer
from penstock.engines.transformers.core.kv_cache import KvArena, KvPair
from penstock.engines.transformers.core.model_runner import ModelRunner, OnRunner
from penstock.engines.transformers.core.prefill_plan import (
    Joined,
    NextChunk,
    Prefiller,
    chunk_cost,
    context_per_token,
)
from penstock.engines.transformers.core.sampling import TokenChoice
from penstock.engines.transformers.core.sequence import Sequence, Submission, completion_usage
from penstock.engines.transformers.core.step_metrics import KvUsage, step_metrics
from penstock.engines.transformers.features.deterministic import DeterministicRunner, OutgoingChunks
from penstock.metrics.forward_pass import ForwardPassMetrics

logger = logging.getLogger(__name__)

DEFAULT_STEP_TOKENS = 2048
# How often a thread with held or frozen requests re-checks them for cancellation.
_HELD_POLL_S = 0.05


class StepFailure(Exception):
    """A forward pass failed; every request that was in it ends with this error."""


class BatchScheduler:
    """Runs the decode loop on its own thread; every public method is thread-safe."""

    # The model (a peft wrapper while LoRA adapters are loaded), whether it is one, and
    # the Llama decoder that replaces its forward in decode steps (see
    # :class:`.model_runner.ModelRunner`).
    model = OnRunner()
    adapters_loaded = OnRunner()
    decoder = OnRunner()

    def __init__(
        self,
        model: Any,
        *,
        device: torch.device,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        max_num_seqs: int,
        kv_capacity_tokens: int,
        seed: int,
        engine_data: Callable[[], dict[str, Any]],
        on_forward_pass: Callable[[ForwardPassMetrics, KvUsage], None],
        worker_id: str = "",
        prefix_caching: bool = True,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        decode_gap_ratio: float | None = None,
        deterministic: bool = False,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``step_tokens``: the tokens one step computes at most, decode rows and prefill
        chunks together (a longer prompt is prefilled over several steps);
        ``decode_gap_ratio``: on the CPU, a step computing prompts while rows decode
        aims at this many times a decode-only step (see :mod:`.chunk_pacing`);
        ``deterministic``: one sequence per forward pass (see :mod:`.deterministic`);
        ``kv_dtype``: the pool's (the model's compute dtype)."""
        runner = DeterministicRunner if deterministic else ModelRunner
        text_config = model.config.get_text_config(decoder=True)
        arena = KvArena.for_model(text_config, kv_capacity_tokens // BLOCK_SIZE, kv_dtype, device)
        self.runner = runner(
            model,
            device,
            seed=seed,
            rows=max_num_seqs,
            vocab=vocab_size,
            ends=eos_token_ids,
            arena=arena,
        )
        self.outgoing = OutgoingChunks(self.runner)
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.worker_id = worker_id
        self._engine_data = engine_data
        self._on_forward_pass = on_forward_pass
        self._cond = threading.Condition()
        # Held by the thread for a whole step; holders of it see no forward pass running.
        self.step_lock = threading.Lock()
        self.kv_events = KvEventRelay()
        self.blocks = BlockManager(
            kv_capacity_tokens // BLOCK_SIZE,
            prefix_caching=prefix_caching,
            on_stored=self.kv_events.stored,
            on_removed=self.kv_events.removed,
            on_cleared=self.kv_events.cleared,
        )
        # In admission order (``Submission.order``).
        self._waiting: list[Submission] = []
        self._admitted: list[Submission] = []
        self._running: list[Sequence] = []
        self.prefiller = Prefiller(
            self.runner,
            self.blocks,
            accept=self._accept,
            cancel=lambda seq, outbox: self._finish(seq, "cancelled", outbox, last_chunk=None),
            send=self._send,
            context=context_per_token(text_config),
        )
        self.step_tokens = step_tokens
        self.pacer = ChunkPacer(decode_gap_ratio if device.type == "cpu" else None)
        self._arrivals = itertools.count()
        self._preemptions = 0
        self._paused = False
        self._frozen = False
        self._sleeping = False
        self._stopping = False
        self._counter = 0
        self._thread: threading.Thread | None = None

    @property
    def kv_total_blocks(self) -> int:
        return self.blocks.total_blocks

    # -- control (any thread) ----------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="penstock-batch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; every unfinished request ends with ``cancelled``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self.step_lock, self._cond:
            pending = list(self._waiting) + list(self._admitted)
            self._waiting.clear()
            self._running.clear()
            self.prefiller.chunked.clear()
            self._admitted.clear()
            self.runner.reset()
        with self._cond:
            for submission in pending:
                self._finish_unstarted(submission, "cancelled")
            self._cond.notify_all()

    def submit(self, submission: Submission) -> None:
        if submission.most_blocks > self.kv_total_blocks:
            raise ValueError(
                f"the request may need {submission.most_blocks * BLOCK_SIZE} KV tokens "
                f"(its prompt and n x max_tokens, in blocks of {BLOCK_SIZE}) but the engine "
                f"holds at most {self.kv_total_blocks * BLOCK_SIZE} (--kv-cache-tokens); "
                "lower max_tokens or n"
            )
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            submission.arrival = next(self._arrivals)
            self._enqueue_locked(submission)
            self._cond.notify_all()

    def _enqueue_locked(self, submission: Submission) -> None:
        bisect.insort(self._waiting, submission, key=lambda s: s.order)

    def attach_kv_events(self, publisher: Any) -> None:
        """Publish the prefix cache's blocks stored and removed to ``publisher``."""
        self.kv_events.publisher = publisher

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (new weights, a flush): no stale prefix is matched."""
        with self.step_lock, self._cond:
            self.blocks.reset()

    def cancel(self, submission: Submission) -> None:
        with self._cond:
            submission.cancelled = True
            self._cond.notify_all()

    def cancel_request_id(self, request_id: str) -> int:
        """Cancel every submission with this request id; returns how many were found."""
        with self._cond:
            found = [
                s
                for s in list(self._waiting) + self._admitted
                if s.request_id == request_id and not s.done
            ]
            for submission in found:
                submission.cancelled = True
            self._cond.notify_all()
        return len(found)

    def pause(self, *, abort: bool, freeze: bool) -> list[Submission]:
        """Stop admitting new requests.

        ``abort`` cancels every request in flight; ``freeze`` stops stepping (requests keep
        their KV); otherwise the requests already submitted run to their end. Returns
        the requests in flight at this moment.
        """
        with self._cond:
            self._paused = True
            self._frozen = freeze
            in_flight = list(self._admitted)
            if abort:
                in_flight += list(self._waiting)
                for submission in in_flight:
                    submission.cancelled = True
            elif not freeze:
                for submission in self._waiting:
                    submission.drain = True
                in_flight += list(self._waiting)
            self._cond.notify_all()
        if freeze:
            # Wait for the step in progress (if any) to end: no forward pass after this.
            with self.step_lock:
                pass
        return in_flight

    def unfinished_with_adapter(self, adapter: str) -> list[Submission]:
        """The submitted requests that run with ``adapter`` and have not ended yet."""
        with self._cond:
            return [
                s
                for s in list(self._waiting) + self._admitted
                if s.adapter == adapter and not s.done
            ]

    def wait_until_done(self, submissions: list[Submission]) -> None:
        """Block until every one of ``submissions`` has ended."""
        with self._cond:
            self._cond.wait_for(lambda: all(s.done for s in submissions))

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._frozen = False
            self._cond.notify_all()

    def set_sleeping(self, sleeping: bool) -> None:
        """While sleeping nothing steps; returns once no forward pass is running."""
        with self._cond:
            self._sleeping = sleeping
            self._cond.notify_all()
        if sleeping:
            with self.step_lock:
                pass

    @property
    def paused(self) -> bool:
        return self._paused

    def usage(self) -> KvUsage:
        with self._cond:
            return self._usage_locked()

    def _usage_locked(self) -> KvUsage:
        blocks = self.blocks
        return KvUsage(
            blocks.used_blocks,
            blocks.total_blocks,
            len(self._running),
            len(self._waiting),
            cached_blocks=blocks.cached_blocks,
            prefill_tokens=blocks.prefill_tokens,
            cached_tokens=blocks.cached_tokens,
            preemptions=self._preemptions,
        )

    def move_kv(self, device: torch.device) -> None:
        """Move the KV of held sequences (call with ``step_lock`` held)."""
        self.runner.move_kv(device)

    # -- the loop (scheduler thread) ------------------------------------------------------

    def _run(self) -> None:
        active = False
        while True:
            with self._cond:
                if self._stopping:
                    return
                self._drop_cancelled_waiting_locked()
                can_step = not (self._frozen or self._sleeping) and (
                    bool(self._running or self.prefiller.chunked) or self._admissible_locked()
                )
                if not can_step:
                    cancelled_rows = any(seq.submission.should_stop() for seq in self._running)
                    if not cancelled_rows:
                        if active:
                            active = False
                            self._emit_heartbeat_locked()
                        held = bool(self._waiting or self._running or self.prefiller.chunked)
                        self._cond.wait(timeout=_HELD_POLL_S if held else None)
                        continue
                admitted = self._admit_locked() if can_step else []
                queued = list(self._waiting)
            with self.step_lock:
                if not can_step:
                    self._release_cancelled_rows()
                    continue
                active = True
                self._step(admitted, queued)

    def _drop_cancelled_waiting_locked(self) -> None:
        if not any(s.should_stop() for s in self._waiting):
            return
        keep: list[Submission] = []
        for submission in self._waiting:
            if submission.should_stop():
                self._finish_unstarted(submission, "cancelled")
            else:
                keep.append(submission)
        self._waiting = keep
        self._cond.notify_all()

    def _admissible_locked(self) -> bool:
        return self._next_locked() is not None

    def _next_locked(self) -> Submission | None:
        """The waiting request to admit next: the first in admission order, unless an
        earlier arrival has been passed over by two batches' worth (``max_num_seqs``) of
        later ones (of a lower ``priority`` value); that one goes first: none starves."""
        if not self._waiting:
            return None
        head = self._waiting[0]
        if self._paused:
            return head if head.drain else None
        oldest = min(self._waiting, key=lambda s: s.arrival)
        return oldest if oldest.passed_over >= 2 * self.max_num_seqs else head

    def _admit_locked(self) -> list[Submission]:
        """The waiting requests, in order, whose rows and prompt blocks fit; the blocks the
        running rows take this step are set aside first."""
        admitted: list[Submission] = []
        rows = len(self._running) + len(self.prefiller.sequences())
        free = self.blocks.free_blocks - sum(
            1 for seq in self._running if len(seq.blocks) * BLOCK_SIZE <= seq.kv_length
        )
        while (head := self._next_locked()) is not None:
            head_rows = sum(1 for seq in head.sequences if not seq.finished) or head.params.n
            if rows + head_rows > self.max_num_seqs:
                break
            needed = head.blocks_to_start()
            if needed > free:
                break
            self._waiting.remove(head)
            for waiting in self._waiting:
                waiting.passed_over += waiting.arrival < head.arrival
            rows += head_rows
            free -= needed
            self._admitted.append(head)
            admitted.append(head)
        return admitted

    def _release_cancelled_rows(self) -> None:
        """Drop rows of cancelled requests while the batch is frozen or paused."""
        outbox: dict[Submission, list[Any]] = {}
        for seq in self._running:
            if seq.submission.should_stop():
                self._finish(seq, "cancelled", outbox, last_chunk=None)
        self._rebuild_batch([])
        self._send(outbox)

    def _step(self, admitted: list[Submission], queued: list[Submission]) -> None:
        started = time.perf_counter()
        outbox: dict[Submission, list[Any]] = {}
        decode_rows: list[Sequence] = []
        try:
            with torch.inference_mode():
                for seq in self._running + self.prefiller.sequences():
                    if seq.submission.should_stop():
                        self._finish(seq, "cancelled", outbox, last_chunk=None)
                self.prefiller.drop_cancelled()
                self._grow()
                self._rebuild_batch([])
                decode_rows = list(self._running)
                # At least a block's worth: a step full of decode rows still prefills.
                budget: float = max(self.step_tokens - len(decode_rows), BLOCK_SIZE)
                # Beside decoding rows a chunk rides in their decode pass (one read of the
                # weights for both) where the runner can; alone it runs by itself.
                fused = bool(decode_rows) and self.runner.fuses_chunks
                if fused:
                    budget = self.pacer.budget(budget)
                elif decode_rows and self.pacer.ratio is not None:
                    budget = min(budget, UNPACED_CPU_CHUNK)
                chunk = self.prefiller.next_chunk(budget) if fused and budget >= 1 else None
                joined: list[Joined] = []
                if decode_rows:
                    budget -= self._decode(decode_rows, chunk, joined, outbox)
                    self._send(outbox)
                joined += self.prefiller.run(admitted, budget, outbox, chunks=not fused)
                self._rebuild_batch(joined)
        except Exception as exc:
            logger.exception("forward pass failed")
            self._fail_all(outbox, StepFailure(f"forward pass failed: {exc}"))
        self._send(outbox)
        self._publish(admitted, decode_rows, queued, time.perf_counter() - started)

    def _decode(
        self,
        rows: list[Sequence],
        chunk: NextChunk | None,
        joined: list[Joined],
        outbox: dict[Submission, list[Any]],
    ) -> float:
        """Decode ``rows`` and ``chunk`` in one pass; the chunk's token-equivalents."""
        target = None if chunk is None else (chunk[0][0], chunk[1])
        start = 0 if target is None else target[0].computed
        started = time.perf_counter()
        choices, prefilled = self.runner.decode(rows, target)
        elapsed = time.perf_counter() - started
        for seq, choice in zip(rows, choices, strict=True):
            self._accept(seq, choice, outbox)
        if chunk is None:
            self.pacer.decoded(elapsed)
            return 0.0
        cost = chunk_cost(start, chunk[1] - start, self.prefiller.context)
        self.pacer.fused(elapsed, cost)
        self.prefiller.computed(chunk[0], prefilled, joined, outbox)
        return cost

    def _grow(self) -> None:
        """Give every running row a block slot for the token it feeds this step; an empty
        pool preempts the request that runs last until the row has one or is preempted."""
        for seq in sorted(self._running, key=lambda seq: seq.submission.order):
            while seq.in_batch and len(seq.blocks) * BLOCK_SIZE <= seq.kv_length:
                if self.blocks.free_blocks:
                    seq.blocks += self.blocks.allocate(1)
                else:
                    self._preempt(max(self._running_submissions(), key=lambda s: s.order))

    def _running_submissions(self) -> list[Submission]:
        return list({seq.submission: None for seq in self._running if seq.in_batch})

    def _preempt(self, submission: Submission) -> None:
        """Free the blocks of ``submission``'s rows and make it wait to be recomputed."""
        logger.debug("preempting request %s: the KV pool is full", submission.request_id)
        self._preemptions += 1
        for seq in submission.sequences:
            if seq.in_batch:
                self._release(seq)
                seq.kv_length, seq.preempted = 0, True
        with self._cond:
            self._admitted.remove(submission)
            # It was running: a pause that lets running requests finish waits for it.
            submission.drain = True
            self._enqueue_locked(submission)

    def _accept(
        self,
        seq: Sequence,
        choice: TokenChoice,
        outbox: dict[Submission, list[Any]],
    ) -> None:
        chunk = seq.take(choice)
        chunk["engine_data"] = self._engine_data()
        reason = seq.finish_reason(self.eos_token_ids)
        if reason is not None:
            self._finish(seq, reason, outbox, last_chunk=chunk)
        else:
            outbox.setdefault(seq.submission, []).extend(self.outgoing.emit(seq, chunk, last=False))

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        outbox: dict[Submission, list[Any]],
        *,
        last_chunk: dict[str, Any] | None,
    ) -> None:
        if seq.finished:
            return
        seq.finished = True
        submission = seq.submission
        chunk = last_chunk or {
            "token_ids": [],
            "index": seq.index,
            "engine_data": self._engine_data(),
        }
        chunk["finish_reason"] = reason
        chunk["completion_usage"] = completion_usage(
            len(submission.prompt_ids), len(seq.output_ids), submission.cached_tokens
        )
        self._release(seq)
        outbox.setdefault(submission, []).extend(self.outgoing.emit(seq, chunk, last=True))
        submission.unfinished -= 1
        if submission.unfinished <= 0:
            self._retire(submission)

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks, the full ones of its computed tokens cached first."""
        tokens = seq.cacheable_tokens
        if len(tokens) >= BLOCK_SIZE:
            self.blocks.store_computed(seq.blocks, tokens, seq.submission.kv_salt, seq.kv_epoch)
        self.blocks.free(seq.blocks)
        seq.blocks = []

    def _retire(self, submission: Submission) -> None:
        with self._cond:
            submission.done = True
            if submission in self._admitted:
                self._admitted.remove(submission)
            self._cond.notify_all()

    def _finish_unstarted(self, submission: Submission, reason: str) -> None:
        """End a waiting request: its choices so far if it was preempted, else all of them."""
        if submission.sequences:
            outbox: dict[Submission, list[Any]] = {}
            for seq in submission.sequences:
                self._finish(seq, reason, outbox, last_chunk=None)
            self._send(outbox)
            return
        submission.done = True
        submission.deliver(
            [
                {
                    "token_ids": [],
                    "index": index,
                    "finish_reason": reason,
                    "completion_usage": completion_usage(len(submission.prompt_ids), 0),
                    "engine_data": self._engine_data(),
                }
                for index in range(submission.params.n)
            ]
        )

    def _fail_all(self, outbox: dict[Submission, list[Any]], error: StepFailure) -> None:
        with self._cond:
            failed = list(self._admitted)
            self._running = []
            self.prefiller.chunked.clear()
        self.runner.reset()
        for submission in failed:
            for seq in submission.sequences:
                self.blocks.free(seq.blocks)
                seq.blocks = []
        for submission in failed:
            outbox.setdefault(submission, []).append(error)
            self._retire(submission)

    def _rebuild_batch(self, joined: list[tuple[Sequence, list[KvPair]]]) -> None:
        """Drop finished rows, trim padding nobody needs, append newly prefilled rows."""
        rows = self.runner.rebuild_batch(self._running, joined)
        if rows is not None:
            with self._cond:
                self._running = rows

    def _send(self, outbox: dict[Submission, list[Any]]) -> None:
        for submission, items in outbox.items():
            submission.deliver(items)
        outbox.clear()

    # -- metrics -------------------------------------------------------------------------

    def _publish(
        self,
        admitted: list[Submission],
        decoded: list[Sequence],
        queued: list[Submission],
        wall_time: float,
    ) -> None:
        self._counter += 1
        metrics = step_metrics(self.worker_id, self._counter, wall_time, admitted, decoded, queued)
        self._on_forward_pass(metrics, self.usage())

    def _emit_heartbeat_locked(self) -> None:
        self._counter += 1
        heartbeat = ForwardPassMetrics(worker_id=self.worker_id, counter_id=self._counter)
        self._on_forward_pass(heartbeat, self._usage_locked())
