"""The per-request metrics of one engine request, recorded as its deltas go by.

:class:`RequestRecorder` is what :meth:`~penstock.serving.generation.Generation.deltas`
tells of each request: it began (active, queued), each token (time to first token,
inter-token latency, tokens streamed), and how it ended (duration, completion tokens, the
requests counter with Dynamo's status and error type).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import perf_counter

from penstock.errors import OverloadedError, PenstockError
from penstock.metrics.frontend import FrontendMetrics
from penstock.serving.deadline import Deadline

# Chunks whose inter-token latency and token count a stream keeps before recording them:
# one histogram observation a token was ~13% of a streamed chunk's CPU.
_FLUSH_EVERY = 64


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
    :meth:`finish`: call :meth:`tokens` for each chunk that brought tokens, then
    :meth:`succeeded` or :meth:`failed`, then :meth:`finish`.

    Per-token observations wait here and reach the families in batches (exact counts; a
    scrape sees a stream's tokens at most ``_FLUSH_EVERY`` late). :attr:`tokens`, and
    what :meth:`finish` calls, are closures over the request's running counts, made per
    request: :attr:`tokens` runs for every chunk, and a cell reads about as fast as a
    local where an attribute of the recorder does not (``bench/contract_cost.py``).
    Neither closure holds the recorder, which would make a cycle of every request.
    """

    __slots__ = ("_finish", "error_type", "status", "tokens")

    tokens: Callable[[int], None]
    """``tokens(count)``: ``count`` tokens arrived in one chunk."""

    def __init__(self, families: FrontendMetrics, model: str, prompt_tokens: int) -> None:
        """``prompt_tokens``: the prompt's length, recorded with the request's first token."""
        metrics = families.for_model(model)
        metrics.active.inc()
        metrics.queued.inc()
        started = last = perf_counter()
        first_token = True
        itl: list[float] = []
        unflushed_tokens = 0
        # What ``finish`` counts unless told otherwise: an error it was not told of.
        self.status = "error"
        self.error_type = "internal"

        def tokens(count: int) -> None:
            nonlocal first_token, last, unflushed_tokens
            now = perf_counter()
            if first_token:
                first_token = False
                metrics.queued.dec()
                metrics.ttft.observe(now - started)
                metrics.input_tokens.observe(prompt_tokens)
            else:
                itl.append((now - last) / count)
            last = now
            unflushed_tokens += count
            # The latencies waiting are never more than the tokens: one flush for both.
            if unflushed_tokens >= _FLUSH_EVERY:
                metrics.itl.observe_many(itl)
                itl.clear()
                metrics.output_tokens_total.inc(unflushed_tokens)
                unflushed_tokens = 0

        def finish(
            completion_tokens: int, endpoint: str, streaming: bool, status: str, error_type: str
        ) -> None:
            metrics.itl.observe_many(itl)
            if unflushed_tokens:
                metrics.output_tokens_total.inc(unflushed_tokens)
            if first_token:
                metrics.queued.dec()
            metrics.active.dec()
            metrics.duration.observe(perf_counter() - started)
            metrics.output_tokens.observe(completion_tokens)
            request_type = "stream" if streaming else "unary"
            families.requests.labels(model, endpoint, request_type, status, error_type).inc()

        self.tokens = tokens
        self._finish = finish

    def succeeded(self) -> None:
        self.status, self.error_type = "success", ""

    def failed(self, exc: BaseException, deadline: Deadline | None) -> None:
        self.status, self.error_type = "error", error_type(exc, deadline)

    def finish(self, completion_tokens: int, endpoint: str, streaming: bool) -> None:
        """The request ended, with ``completion_tokens`` over all its choices."""
        self._finish(completion_tokens, endpoint, streaming, self.status, self.error_type)
