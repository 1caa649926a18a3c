"""Continuous batching over a Hugging Face causal LM, on one dedicated thread.

Why a scheduler of our own: transformers' ``ContinuousBatchingManager`` fixes its sampling
setup per manager (only temperature/top-k/top-p have per-request variants, and only when
the manager's GenerationConfig enables them); it has no per-request seed, min-p,
penalties, min_tokens, top logprobs or ``n``. This scheduler keeps the model's own forward
and adds what a server needs around it; decode steps of Llama-architecture models run
:mod:`.llama_decode` instead, the same logits with far less Python per step.

Layout: every running sequence is one row of a batched :class:`.kv_cache.BatchKv`,
right-aligned (left padding), so one decode step appends one column for all rows in
place. Each row's real tokens are selected by an attention mask and its own position
ids. Membership changes only at step boundaries: the requests admitted in a step are
prefilled together, left-padded in one forward pass (a prompt's padding is masked out, so
its first token depends on its neighbours only through the rounding of the matrix
products, whose algorithm follows the batch's row count), then each one's KV is written
into a free row of the batch; a finished or cancelled sequence's row is given to
another, and padding columns no row needs any more are trimmed. The buffers are released
when the batch empties, or reallocated smaller when rows leave most of them unused.

With LoRA adapters loaded, each row names its adapter (or none) in the forward pass, so
requests for different adapters and for the base model share one batch.

Admission reserves ``n * (prompt + max_tokens)`` tokens of the KV budget; a request that
fits waits in FIFO order, so a running long request never blocks a short one from
starting, and no running sequence is ever preempted.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from penstock.engines.context import Context
from penstock.engines.transformers.kv_cache import BatchKv, KvPair
from penstock.engines.transformers.llama_decode import LlamaDecoder
from penstock.engines.transformers.lora import BASE_ROW
from penstock.engines.transformers.sampling import (
    PenaltyState,
    RowSampling,
    SamplingParams,
    TokenChoice,
    choose_tokens,
)
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


Deliver = Callable[[list[Any]], None]


@dataclass(eq=False)
class Submission:
    """One ``generate`` call: a prompt and ``n`` choices decoded as separate sequences."""

    request_id: str
    context: Context
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Deliver
    # peft's name of the LoRA adapter the request runs with; None runs the base model.
    adapter: str | None = None
    # Builds the prompt's ``inputs_embeds`` from (model, prompt ids) at prefill, for
    # prompts whose placeholder tokens stand for image features; None feeds the ids.
    embed: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    cancelled: bool = False
    # Arrived before a pause in "wait" mode: still runs, the pause waits for it.
    drain: bool = False
    done: bool = False
    unfinished: int = 0

    @property
    def reserved_tokens(self) -> int:
        return self.params.n * (len(self.prompt_ids) + self.params.max_tokens)

    def should_stop(self) -> bool:
        return self.cancelled or self.context.is_stopped()


@dataclass(eq=False)
class Sequence:
    """One choice of a submission: one row of the decode batch."""

    submission: Submission
    index: int
    generator: torch.Generator | None
    penalties: PenaltyState | None
    output_ids: list[int] = field(default_factory=list)
    kv_length: int = 0
    next_token: int = 0
    finished: bool = False


@dataclass(frozen=True)
class KvUsage:
    used_blocks: int
    total_blocks: int
    running: int
    waiting: int


class BatchScheduler:
    """Runs the decode loop on its own thread; every public method is thread-safe."""

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
        self.model = model
        # True while ``model`` is a peft wrapper: every forward pass then names each
        # row's adapter (set together with ``model``, under ``step_lock``).
        self.adapters_loaded = False
        # Decode steps run this instead of ``model``'s forward when set and no adapter is
        # loaded (see :mod:`.llama_decode`); set together with ``model``.
        self.decoder: LlamaDecoder | None = None
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens
        self.worker_id = worker_id
        self._engine_data = engine_data
        self._on_forward_pass = on_forward_pass
        self._shared_generator = torch.Generator(device=device)
        self._shared_generator.manual_seed(seed)
        self._cond = threading.Condition()
        # Held by the thread for a whole step; holders of it see no forward pass running.
        self.step_lock = threading.Lock()
        self._waiting: deque[Submission] = deque()
        self._admitted: list[Submission] = []
        self._running: list[Sequence] = []
        self._cache: BatchKv | None = None
        self._width = 0
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
            self._cache = None
            self._width = 0
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
        if self._cache is not None:
            self._cache.to(device)

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
        width = self._width
        kv_lengths = [seq.kv_length for seq in rows]
        lengths = torch.tensor(kv_lengths, device=self.device)
        token_ids = torch.tensor([seq.next_token for seq in rows], device=self.device)
        cache = self._cache
        assert cache is not None
        cache.reserve(1, limit=max(self._remaining(seq) for seq in rows))
        if self.decoder is not None and not self.adapters_loaded:
            attention_mask = None
            if min(kv_lengths) < width:
                columns = torch.arange(width + 1, device=self.device)
                attention_mask = (columns >= (width - lengths).unsqueeze(1))[:, None, None, :]
            logits = self.decoder.decode(token_ids, lengths, cache, attention_mask)
        else:
            columns = torch.arange(width + 1, device=self.device).unsqueeze(0)
            output = self.model(
                input_ids=token_ids.unsqueeze(1),
                attention_mask=(columns >= (width - lengths).unsqueeze(1)).long(),
                position_ids=lengths.unsqueeze(1),
                cache=cache,
                use_cache=True,
                **self._adapter_names(seq.submission for seq in rows),
            )
            logits = output.logits[:, -1, :]
        self._width = width + 1
        for seq in rows:
            seq.kv_length += 1
        choices = choose_tokens(logits, [self._row(seq) for seq in rows], self._shared_generator)
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
            sequences = [self._new_sequence(submission, i) for i in range(submission.params.n)]
            if submission.should_stop():
                for seq in sequences:
                    self._finish(seq, "cancelled", outbox, last_chunk=None)
            else:
                live.append((submission, sequences))
        if not live:
            return []
        submissions = [submission for submission, _ in live]
        longest = max(len(s.prompt_ids) for s in submissions)
        if len(live) == 1:
            submission = submissions[0]
            prompt = torch.tensor([submission.prompt_ids], device=self.device)
            if submission.embed is None:
                inputs: dict[str, Any] = {"input_ids": prompt}
            else:
                inputs = {"inputs_embeds": submission.embed(self.model, prompt)}
        else:
            # Left padding: every prompt's last token is in the last column, where the
            # logits are kept. Padding positions are masked out and their KV dropped.
            ids = torch.zeros((len(live), longest), dtype=torch.long)
            attention_mask = torch.zeros((len(live), longest), dtype=torch.long)
            for row, submission in enumerate(submissions):
                length = len(submission.prompt_ids)
                ids[row, longest - length :] = torch.tensor(submission.prompt_ids)
                attention_mask[row, longest - length :] = 1
            positions = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
            inputs = {
                "input_ids": ids.to(self.device),
                "attention_mask": attention_mask.to(self.device),
                "position_ids": positions.to(self.device),
            }
        output = self.model(
            **inputs,
            cache=DynamicCache(),
            use_cache=True,
            logits_to_keep=1,
            **self._adapter_names(submissions),
        )
        joined = []
        for row, (submission, sequences) in enumerate(live):
            length = len(submission.prompt_ids)
            layers = [
                (
                    layer.keys[row : row + 1, :, longest - length :],
                    layer.values[row : row + 1, :, longest - length :],
                )
                for layer in output.cache.layers
            ]
            logits = output.logits[row : row + 1, -1, :].expand(len(sequences), -1)
            choices = choose_tokens(
                logits, [self._row(seq) for seq in sequences], self._shared_generator
            )
            for seq, choice in zip(sequences, choices, strict=True):
                seq.kv_length = length
                self._accept(seq, choice, outbox)
                if not seq.finished:
                    joined.append((seq, layers))
        return joined

    @staticmethod
    def _remaining(seq: Sequence) -> int:
        """Decode steps the row may still take (its last token is never fed back)."""
        return max(seq.submission.params.max_tokens - len(seq.output_ids), 1)

    def _adapter_names(self, submissions: Iterable[Submission]) -> dict[str, Any]:
        if not self.adapters_loaded:
            return {}
        return {"adapter_names": [s.adapter or BASE_ROW for s in submissions]}

    def _new_sequence(self, submission: Submission, index: int) -> Sequence:
        params = submission.params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed + index)
        penalties = None
        if params.has_penalties:
            penalties = PenaltyState(submission.prompt_ids, self.vocab_size, self.device)
        return Sequence(submission, index, generator, penalties)

    def _row(self, seq: Sequence) -> RowSampling:
        params = seq.submission.params
        banned: list[int] = []
        if len(seq.output_ids) < params.min_tokens:
            banned = sorted(params.stop_token_ids | self.eos_token_ids)
        return RowSampling(params, len(seq.output_ids), banned, seq.generator, seq.penalties)

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
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
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
        chunk["completion_usage"] = _usage(len(submission.prompt_ids), len(seq.output_ids))
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
                    "completion_usage": _usage(len(submission.prompt_ids), 0),
                    "engine_data": self._engine_data(),
                }
                for index in range(submission.params.n)
            ]
        )

    def _fail_all(self, outbox: dict[Submission, list[Any]], error: StepFailure) -> None:
        with self._cond:
            failed = list(self._admitted)
            self._running = []
        self._cache = None
        self._width = 0
        for submission in failed:
            outbox.setdefault(submission, []).append(error)
            self._retire(submission)

    def _rebuild_batch(self, joined: list[tuple[Sequence, list[KvPair]]]) -> None:
        """Drop finished rows, trim padding nobody needs, append newly prefilled rows."""
        keep = [i for i, seq in enumerate(self._running) if not seq.finished]
        if len(keep) == len(self._running) and not joined:
            return
        if self._cache is not None:
            order = self._cache.keep_rows(keep) if len(keep) != len(self._running) else keep
            survivors = [self._running[i] for i in order]
        else:
            survivors = []
        rows = survivors + [seq for seq, _ in joined]
        with self._cond:
            self._running = rows
        if not rows:
            self._cache = None
            self._width = 0
            return
        width = max(seq.kv_length for seq in rows)
        headroom = max(self._remaining(seq) for seq in rows)
        if self._cache is None:
            self._cache = BatchKv(joined[0][1], row_capacity=len(joined))
        self._cache.set_width(width, headroom=headroom)
        if joined:
            self._cache.add_rows([layers for _, layers in joined], self.max_num_seqs)
        self._width = width

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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
