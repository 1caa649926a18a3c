"""Continuous batching over a Hugging Face causal LM, on one dedicated thread.

Why a scheduler of our own: transformers' ``ContinuousBatchingManager`` fixes its sampling
setup per manager (only temperature/top-k/top-p have per-request variants, and only when
the manager's GenerationConfig enables them); it has no per-request seed, min-p,
penalties, min_tokens, top logprobs or ``n``. This scheduler keeps the model's own forward
and adds what a server needs around it.

The parts, one concept each: :mod:`.sequence` (a request and its choices),
this module (admission, batch composition, the step loop, the chunks each token becomes),
:mod:`.model_runner` (the forward passes and the KV cache they run over). Membership of
the batch changes only at step boundaries: the requests admitted in a step are prefilled
together (:func:`_prefill_groups`) and join the running rows, which decode one token per
step until they finish or are cancelled.

Admission reserves ``n * (prompt + max_tokens)`` tokens of the KV budget
(``kv_capacity_tokens``, counted in ``KV_BLOCK_SIZE`` blocks for the metrics); a request
that fits waits in FIFO order, so a running long request never blocks a short one from
starting, and no running sequence is ever preempted.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from penstock.engines.transformers.kv_cache import KvPair
from penstock.engines.transformers.model_runner import ModelRunner
from penstock.engines.transformers.sampling import TokenChoice
from penstock.engines.transformers.sequence import Sequence, Submission, completion_usage
from penstock.metrics.forward_pass import (
    ForwardPassMetrics,
    WelfordAccumulator,
    forward_pass_from,
)

logger = logging.getLogger(__name__)

KV_BLOCK_SIZE = 16
# Prompts prefilled in one forward pass: at most this many tokens, padding included.
PREFILL_BATCH_TOKENS = 2048
# How often a thread with held or frozen requests re-checks them for cancellation.
_HELD_POLL_S = 0.05


class StepFailure(Exception):
    """A forward pass failed; every request that was in it ends with this error."""


@dataclass(frozen=True)
class KvUsage:
    used_blocks: int
    total_blocks: int
    running: int
    waiting: int


class _OnRunner:
    """An attribute the engine sets on the scheduler, held by its model runner: set with
    ``step_lock`` held, between two forward passes."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, scheduler: BatchScheduler, owner: type | None = None) -> Any:
        return getattr(scheduler.runner, self.name)

    def __set__(self, scheduler: BatchScheduler, value: Any) -> None:
        setattr(scheduler.runner, self.name, value)


class BatchScheduler:
    """Runs the decode loop on its own thread; every public method is thread-safe."""

    # The model (a peft wrapper while LoRA adapters are loaded), whether it is one, and
    # the Llama decoder that replaces its forward in decode steps (see
    # :class:`.model_runner.ModelRunner`).
    model = _OnRunner()
    adapters_loaded = _OnRunner()
    decoder = _OnRunner()

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
    ) -> None:
        self.runner = ModelRunner(
            model, device, seed=seed, rows=max_num_seqs, vocab=vocab_size, ends=eos_token_ids
        )
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens
        self.worker_id = worker_id
        self._engine_data = engine_data
        self._on_forward_pass = on_forward_pass
        self._cond = threading.Condition()
        # Held by the thread for a whole step; holders of it see no forward pass running.
        self.step_lock = threading.Lock()
        self._waiting: deque[Submission] = deque()
        self._admitted: list[Submission] = []
        self._running: list[Sequence] = []
        self._reserved_tokens = 0
        self._paused = False
        self._frozen = False
        self._sleeping = False
        self._stopping = False
        self._counter = 0
        self._thread: threading.Thread | None = None

    @property
    def kv_total_blocks(self) -> int:
        return self.kv_capacity_tokens // KV_BLOCK_SIZE

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
            self._admitted.clear()
            self.runner.reset()
        with self._cond:
            for submission in pending:
                self._finish_unstarted(submission, "cancelled")
            self._cond.notify_all()

    def submit(self, submission: Submission) -> None:
        if submission.reserved_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"the request needs {submission.reserved_tokens} KV tokens "
                f"(n x (prompt + max_tokens)) but the engine holds at most "
                f"{self.kv_capacity_tokens} (--kv-cache-tokens); lower max_tokens or n"
            )
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._waiting.append(submission)
            self._cond.notify_all()

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
        used = sum(math.ceil(seq.kv_length / KV_BLOCK_SIZE) for seq in self._running)
        return KvUsage(used, self.kv_total_blocks, len(self._running), len(self._waiting))

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
                    bool(self._running) or self._admissible_locked()
                )
                if not can_step:
                    cancelled_rows = any(seq.submission.should_stop() for seq in self._running)
                    if not cancelled_rows:
                        if active:
                            active = False
                            self._emit_heartbeat_locked()
                        held = bool(self._waiting or self._running)
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
        keep: deque[Submission] = deque()
        for submission in self._waiting:
            if submission.should_stop():
                self._finish_unstarted(submission, "cancelled")
            else:
                keep.append(submission)
        self._waiting = keep
        self._cond.notify_all()

    def _admissible_locked(self) -> bool:
        return bool(self._waiting) and (not self._paused or self._waiting[0].drain)

    def _admit_locked(self) -> list[Submission]:
        admitted: list[Submission] = []
        rows = len(self._running)
        while self._admissible_locked():
            head = self._waiting[0]
            if rows + head.params.n > self.max_num_seqs:
                break
            if self._reserved_tokens + head.reserved_tokens > self.kv_capacity_tokens:
                break
            self._waiting.popleft()
            rows += head.params.n
            self._reserved_tokens += head.reserved_tokens
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
                for seq in self._running:
                    if seq.submission.should_stop():
                        self._finish(seq, "cancelled", outbox, last_chunk=None)
                self._rebuild_batch([])
                decode_rows = list(self._running)
                if decode_rows:
                    self._decode(decode_rows, outbox)
                    self._send(outbox)
                joined: list[tuple[Sequence, list[KvPair]]] = []
                for group in _prefill_groups(admitted):
                    joined += self._prefill(group, outbox)
                    # Each first token leaves as soon as it exists: TTFT does not wait
                    # for the other prefills of this step.
                    self._send(outbox)
                self._rebuild_batch(joined)
        except Exception as exc:
            logger.exception("forward pass failed")
            self._fail_all(outbox, StepFailure(f"forward pass failed: {exc}"))
        self._send(outbox)
        self._publish(admitted, decode_rows, queued, time.perf_counter() - started)

    def _decode(self, rows: list[Sequence], outbox: dict[Submission, list[Any]]) -> None:
        choices = self.runner.decode(rows)
        for seq, choice in zip(rows, choices, strict=True):
            self._accept(seq, choice, outbox)

    def _prefill(
        self, group: list[Submission], outbox: dict[Submission, list[Any]]
    ) -> list[tuple[Sequence, list[KvPair]]]:
        """Prefill ``group`` in one forward pass (see ``_prefill_groups``); returns the
        sequences that go on decoding, each with its prompt's KV per layer."""
        live: list[tuple[Submission, list[Sequence]]] = []
        for submission in group:
            submission.unfinished = submission.params.n
            sequences = self.runner.new_sequences(submission)
            if submission.should_stop():
                for seq in sequences:
                    self._finish(seq, "cancelled", outbox, last_chunk=None)
            else:
                live.append((submission, sequences))
        if not live:
            return []
        joined = []
        prefilled = self.runner.prefill(live)
        for (_, sequences), (choices, layers) in zip(live, prefilled, strict=True):
            for seq, choice in zip(sequences, choices, strict=True):
                self._accept(seq, choice, outbox)
                if not seq.finished:
                    joined.append((seq, layers))
        return joined

    def _accept(
        self,
        seq: Sequence,
        choice: TokenChoice,
        outbox: dict[Submission, list[Any]],
    ) -> None:
        params = seq.submission.params
        token = choice.token_id
        seq.output_ids.append(token)
        seq.next_token = token
        if seq.penalties is not None:
            seq.penalties.record(token)
        chunk: dict[str, Any] = {"token_ids": [token], "index": seq.index}
        if choice.logprob is not None:
            chunk["log_probs"] = [choice.logprob]
            if choice.top_logprobs is not None:
                chunk["top_logprobs"] = [choice.top_logprobs]
        chunk["engine_data"] = self._engine_data()
        if (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.eos_token_ids)
            or (seq.constraint is not None and seq.constraint.complete)
        ):
            self._finish(seq, "stop", outbox, last_chunk=chunk)
        elif len(seq.output_ids) >= params.max_tokens:
            self._finish(seq, "length", outbox, last_chunk=chunk)
        else:
            outbox.setdefault(seq.submission, []).append(chunk)

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
            len(submission.prompt_ids), len(seq.output_ids)
        )
        outbox.setdefault(submission, []).append(chunk)
        submission.unfinished -= 1
        if submission.unfinished <= 0:
            self._retire(submission)

    def _retire(self, submission: Submission) -> None:
        with self._cond:
            submission.done = True
            if submission in self._admitted:
                self._admitted.remove(submission)
                self._reserved_tokens -= submission.reserved_tokens
            self._cond.notify_all()

    def _finish_unstarted(self, submission: Submission, reason: str) -> None:
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
        self.runner.reset()
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
        prefill = WelfordAccumulator()
        for submission in admitted:
            prefill.add(len(submission.prompt_ids))
        decode = WelfordAccumulator()
        for seq in decoded:
            decode.add(seq.kv_length)
        waiting = WelfordAccumulator()
        for submission in queued:
            waiting.add(len(submission.prompt_ids))
        self._counter += 1
        metrics = forward_pass_from(
            self.worker_id, self._counter, max(wall_time, 1e-9), prefill, decode, waiting
        )
        self._on_forward_pass(metrics, self.usage())

    def _emit_heartbeat_locked(self) -> None:
        self._counter += 1
        heartbeat = ForwardPassMetrics(worker_id=self.worker_id, counter_id=self._counter)
        self._on_forward_pass(heartbeat, self._usage_locked())


def _prefill_groups(admitted: list[Submission]) -> list[list[Submission]]:
    """``admitted`` in order, as the groups prefilled together.

    Text prompts join the group before them while the padded batch stays within
    ``PREFILL_BATCH_TOKENS``: one pass reads the weights once for all of them, and at
    many rows the linear layers run as one large matrix product. A prompt with image
    features is prefilled alone.
    """
    groups: list[list[Submission]] = []
    longest = 0
    for submission in admitted:
        length = len(submission.prompt_ids)
        group = groups[-1] if groups else None
        if (
            group is not None
            and submission.embed is None
            and group[0].embed is None
            and (len(group) + 1) * max(longest, length) <= PREFILL_BATCH_TOKENS
        ):
            group.append(submission)
            longest = max(longest, length)
        else:
            groups.append([submission])
            longest = length
    return groups
