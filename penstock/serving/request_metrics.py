"""The per-request metrics of one engine request, recorded as its deltas go by.

:class:`RequestRecorder` is what :meth:`~penstock.serving.generation.Generation.deltas`
tells of each request: it began (active, queued), its first token (time to first token),
its tokens in batches (inter-token latency, tokens streamed), and how it ended (duration,
completion tokens, the requests counter with Dynamo's status and error type).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from time import perf_counter

from penstock.errors import OverloadedError, PenstockError
from penstock.metrics.frontend import FrontendMetrics, ModelMetrics
from penstock.serving.deadline import Deadline

FLUSH_EVERY = 64
"""Tokens a stream keeps the inter-token latencies and count of before recording them:
one histogram observation a token was ~13% of a streamed chunk's CPU."""


# Finish reasons shown as they are; the others (tool calls, a content filter) are a stop.
_SHOWN_REASONS = frozenset({"stop", "length", "abort"})
# Error types of a request that ended because it was cut short, not because it failed.
_ABORTED = frozenset({"cancelled", "response_timeout"})


def error_type(exc: BaseException, deadline: Deadline | None) -> str:
    """The ``error_type`` label of a request that ended by ``exc``."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        # Dynamo's label for a response that ran out of time.
        return "response_timeout" if deadline and deadline.expired else "cancelled"
    if isinstance(exc, OverloadedError):
        return "overload"
    if isinstance(exc, PenstockError) and exc.status_code < 500:
        return "validation"
    return "internal"


class RequestRecorder:
    """The metrics of one engine request, from its start (made on construction) to
    :meth:`finish`: :meth:`first_token` when its first tokens arrive, :meth:`flush` with
    the inter-token latencies and tokens counted since the last flush, once they are
    :data:`FLUSH_EVERY` tokens or more, then :meth:`succeeded` or :meth:`failed`, then
    :meth:`finish` with what was not flushed.

    The stream's loop counts the tokens between flushes in its own locals rather than
    calling here for every chunk (a call a chunk was about 1% of a streamed chunk's CPU,
    ``bench/README.md``); a scrape sees a stream's tokens at most ``FLUSH_EVERY`` late.
    """

    __slots__ = (
        "_families",
        "_metrics",
        "_model",
        "_prompt_tokens",
        "_queued",
        "_started",
        "error_type",
        "status",
    )

    def __init__(self, families: FrontendMetrics, model: str, prompt_tokens: int) -> None:
        """``prompt_tokens``: the prompt's length, recorded with the request's first token."""
        self._families = families
        self._model = model
        self._prompt_tokens = prompt_tokens
        metrics = self._metrics = families.for_model(model)
        metrics.active.inc()
        metrics.queued.inc()
        self._queued = True
        self._started = perf_counter()
        # What ``finish`` counts unless told otherwise: an error it was not told of.
        self.status = "error"
        self.error_type = "internal"

    def first_token(self, now: float) -> None:
        """The request's first tokens arrived at ``now`` (``perf_counter``'s clock)."""
        metrics = self._metrics
        self._queued = False
        metrics.queued.dec()
        metrics.ttft.observe(now - self._started)
        metrics.input_tokens.observe(self._prompt_tokens)

    def flush(self, itl: list[float], tokens: int) -> None:
        """Record ``itl`` (seconds a token between chunks, emptied here) and ``tokens``."""
        _flush(self._metrics, itl, tokens)

    def succeeded(self) -> None:
        self.status, self.error_type = "success", ""

    def failed(self, exc: BaseException, deadline: Deadline | None) -> None:
        self.status, self.error_type = "error", error_type(exc, deadline)

    def finish(
        self,
        itl: list[float],
        tokens: int,
        completion_tokens: int,
        endpoint: str,
        streaming: bool,
        finish_reasons: Sequence[str | None] = (),
    ) -> None:
        """The request ended, with ``itl`` and ``tokens`` not yet flushed,
        ``completion_tokens`` over all its choices and how each choice ended (None: it
        did not)."""
        metrics = self._metrics
        _flush(metrics, itl, tokens)
        if self._queued:
            metrics.queued.dec()
        metrics.active.dec()
        metrics.duration.observe(perf_counter() - self._started)
        metrics.output_tokens.observe(completion_tokens)
        request_type = "stream" if streaming else "unary"
        self._families.requests.labels(
            self._model, endpoint, request_type, self.status, self.error_type
        ).inc()
        finished = self._families.finished_choices
        for reason in finish_reasons:
            finished.labels(self._model, self._finished_as(reason)).inc()

    def _finished_as(self, reason: str | None) -> str:
        """vLLM's ``finished_reason`` of a choice: stop, length, abort or error."""
        if reason is None:
            return "abort" if self.error_type in _ABORTED else "error"
        return reason if reason in _SHOWN_REASONS else "stop"


def _flush(metrics: ModelMetrics, itl: list[float], tokens: int) -> None:
    if itl:
        metrics.itl.observe_many(itl)
        itl.clear()
    if tokens:
        metrics.output_tokens_total.inc(tokens)
