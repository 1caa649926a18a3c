"""The in-process worker that drives one engine through the contract.

:class:`EngineHost` owns the guarantees an engine may rely on (see
:mod:`penstock.engines.contract`) and the ones the gateway relies on in return:

* ``start``/``cleanup`` are serialized; cleanup runs once after any ``start`` attempt and
  never without one;
* every request stream ends in exactly one terminal per choice, or an :class:`EngineError`;
  chunks after a terminal are logged as contract violations and dropped;
* cancellation: the request's context is marked stopped (``cancel``) or killed (its
  consumer went away) first; the engine keeps running in its own task, sees the mark
  between yields and ends with ``finish_reason="cancelled"`` (within
  :data:`~penstock.engines.handoff.CANCEL_GRACE_S`, else its stream is closed); then
  ``abort(context)`` runs once. A natural completion never looks cancelled and never
  aborts;
* an engine that advertises ``CANCEL_SAFE_RUNTIME_KEY`` gives up its own task: its
  ``generate`` runs in the consumer's task, with no hand-off per chunk. A consumer going
  away reaches it at once, as ``CancelledError`` at the ``await`` it is in or as the
  stream being closed at its ``yield``; its stream is closed after its last terminal. A
  cancel (a stop mark) and the single ``abort`` are as for any engine;
* decode role (``disaggregation_mode`` decode): ``abort`` waits for the request's first
  token and is skipped when the request ends before one;
* ``n`` > 1 on an engine that does not advertise ``MULTI_CHOICE_RUNTIME_KEY`` runs as n
  single-choice requests (:mod:`penstock.engines.fan_out`) merged as choices; stopping
  the request stops all of them, each aborted once; together they take one admission
  slot;
* ``top_logprobs``: at most the requested k per position (Dynamo engines report the
  chosen token plus k alternatives; the k most likely are kept);
* engine exceptions become client statuses as Dynamo maps them
  (:func:`~penstock.engines.engine_errors.engine_exception_to_error`);
* every optional method an engine lacks gets its documented default
  (:func:`~penstock.engines.contract.fill_optional_hooks`);
* an idle canary (``health_check_payload`` or the operator override) probes ``generate``
  on the :class:`EngineHealthMonitorConfig` cadence and drives :attr:`health`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from penstock.engines.admission import AdmissionGate
from penstock.engines.constants import ModelInput
from penstock.engines.context import Context
from penstock.engines.contract import (
    CANCEL_SAFE_RUNTIME_KEY,
    MULTI_CHOICE_RUNTIME_KEY,
    BaseEngine,
    EngineConfig,
    fill_optional_hooks,
    model_input_of,
)
from penstock.engines.engine_errors import engine_exception_to_error
from penstock.engines.fan_out import fan_out
from penstock.engines.handoff import (
    END,
    Handoff,
    drain_after_terminal,
    log_contract_violation,
    pump,
    wind_down,
)
from penstock.engines.health import HEALTH_CHECK_KEY, EngineHealthMonitorConfig, is_probe
from penstock.engines.tasks import cancel_and_wait, spawn_kept
from penstock.errors import EngineError, PenstockError

logger = logging.getLogger(__name__)

# The choices of a request that have ended, before the first one does.
_NONE_ENDED: frozenset[int] = frozenset()


class EngineState(enum.Enum):
    INIT = "init"
    RUNNING = "running"
    START_FAILED = "start_failed"
    STOPPED = "stopped"


@dataclass
class HealthStatus:
    healthy: bool = True
    reason: str | None = None
    checked_at: float | None = None


@dataclass(slots=True)
class _RequestMarks:
    """What the host has done for one request, so ``abort`` runs at most once."""

    abort_sent: bool = False
    # Ended naturally (or fanned out: the engine never saw this context): never aborted.
    finished: bool = False
    # A ``generate`` is running for it; that one sends the abort when it ends.
    active: bool = False


def _top_k_of(request: dict[str, Any]) -> int | None:
    """The request's ``top_logprobs`` k, or None."""
    top_k = (request.get("output_options") or {}).get("logprobs")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        return None
    return top_k


def _trimmed(positions: list[list[dict[str, Any]] | None], k: int) -> list[list[dict[str, Any]]]:
    return [_top(alternatives, k) for alternatives in positions]


def _top(alternatives: list[dict[str, Any]] | None, k: int) -> list[dict[str, Any]]:
    """The ``k`` most likely alternatives of one position: Dynamo engines report the
    chosen token plus k alternatives, OpenAI's ``top_logprobs`` holds exactly k."""
    if not alternatives or len(alternatives) <= k:
        return alternatives or []
    ranked = sorted(alternatives, key=lambda alt: alt.get("logprob", float("-inf")), reverse=True)
    return ranked[:k]


def served_model_name_of(worker_config: Any, engine_config: EngineConfig | None) -> str:
    """The name the model is served under: the worker config's, else the one the
    started engine reported, else its model."""
    configured = getattr(worker_config, "served_model_name", None)
    if configured:
        return str(configured)
    if engine_config is None:
        raise RuntimeError("engine not started")
    return engine_config.served_model_name or engine_config.model


class EngineHost:
    """Drives one engine's lifecycle and every request through it."""

    def __init__(
        self,
        engine: BaseEngine,
        worker_config: Any,
        *,
        monitor: EngineHealthMonitorConfig | None = None,
        health_check_override: dict[str, Any] | None = None,
    ) -> None:
        """Raises :class:`~penstock.errors.EngineLoadError` if ``engine`` is not an engine."""
        self.engine = engine
        self.model_input = model_input_of(engine)
        filled = fill_optional_hooks(engine)
        if filled:
            logger.info("engine lacks %s; using the contract's defaults", ", ".join(filled))
        self.worker_config = worker_config
        self.monitor = monitor or EngineHealthMonitorConfig.from_env()
        self.worker_id = secrets.randbits(63)
        self.state = EngineState.INIT
        self.engine_config: EngineConfig | None = None
        self.health = HealthStatus()
        self.health_check_payload: dict[str, Any] | None = None
        self._health_check_override = health_check_override
        self._lifecycle_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._inflight = 0
        self._last_activity = time.monotonic()
        self._monitor_task: asyncio.Task[None] | None = None
        # Keyed weakly by the context: ``cancel`` may come before, during or after
        # ``generate``, so the marks live exactly as long as the request's context.
        self._marks: weakref.WeakKeyDictionary[Context, _RequestMarks] = weakref.WeakKeyDictionary()
        self.admission: AdmissionGate | None = None
        mode = getattr(worker_config, "disaggregation_mode", None)
        # Compared by value: a Dynamo WorkerConfig carries Dynamo's own enum.
        self.defers_abort = getattr(mode, "value", mode) == "decode"
        # Read from the engine's config once it has started.
        self.cancel_safe = False

    @property
    def multi_choice(self) -> bool:
        """Whether the engine yields ``n`` choices itself (else the host fans ``n`` out)."""
        config = self.engine_config
        runtime_data = (config.runtime_data if config is not None else None) or {}
        return runtime_data.get(MULTI_CHOICE_RUNTIME_KEY) is True

    @property
    def is_raw(self) -> bool:
        return self.model_input is ModelInput.Text

    @property
    def served_model_name(self) -> str:
        return served_model_name_of(self.worker_config, self.engine_config)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> EngineConfig:
        """Start the engine; on failure clean up the partial state and re-raise."""
        async with self._lifecycle_lock:
            if self.state is not EngineState.INIT:
                raise RuntimeError(f"engine host already {self.state.value}")
            try:
                config = await self.engine.start(self.worker_id)
            except BaseException:
                self.state = EngineState.START_FAILED
                await self._cleanup_locked()
                raise
            if not isinstance(config, EngineConfig) and not hasattr(config, "model"):
                self.state = EngineState.START_FAILED
                await self._cleanup_locked()
                raise TypeError("start() must return an EngineConfig")
            self.engine_config = config
            self.cancel_safe = (config.runtime_data or {}).get(CANCEL_SAFE_RUNTIME_KEY) is True
            self.state = EngineState.RUNNING
        await self._resolve_health_check_payload()
        return config

    async def cleanup(self) -> None:
        """Run ``engine.cleanup()`` once if ``start`` was attempted; later calls do nothing."""
        async with self._lifecycle_lock:
            await self._cleanup_locked()

    async def _cleanup_locked(self) -> None:
        await self.stop_monitor()
        if self.state in (EngineState.RUNNING, EngineState.START_FAILED):
            try:
                await self.engine.cleanup()
            except Exception:
                logger.exception("engine cleanup failed")
        self.state = EngineState.STOPPED

    async def _resolve_health_check_payload(self) -> None:
        """Operator override (CLI/env) replaces the engine's canary whole."""
        payload: Any = self._health_check_override
        if payload is None:
            payload = getattr(self.worker_config, "health_check_payload", None)
        if payload is None:
            try:
                payload = await self.engine.health_check_payload()
            except Exception:
                logger.warning("health_check_payload() raised; canary disabled", exc_info=True)
                payload = None
        if payload is not None and not isinstance(payload, dict):
            logger.warning("health check payload is not an object; canary disabled")
            payload = None
        if payload is not None:
            payload = {**payload, HEALTH_CHECK_KEY: True}
        self.health_check_payload = payload

    # -- requests --------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` detached from the caller's cancellation, keeping a reference."""
        return spawn_kept(self._background, coro)

    def cancel(self, context: Context) -> None:
        """Cancel a request on the caller's behalf: mark it stopped; the engine ends it
        with ``finish_reason="cancelled"`` and is then aborted once.

        Every caller (a client gone, a deadline, an admin abort, a stop string) goes
        through here, so each gets the same order and the decode-role rule.
        """
        context.stop_generating()
        if not self._marks_of(context).active:
            self._schedule_abort(context)

    def _marks_of(self, context: Context) -> _RequestMarks:
        marks = self._marks.get(context)
        if marks is None:
            marks = self._marks[context] = _RequestMarks()
        return marks

    def _schedule_abort(self, context: Context) -> None:
        marks = self._marks_of(context)
        if marks.abort_sent or marks.finished:
            return
        if self.defers_abort and not context.first_token_seen:
            # Decode role: the prefill peer owns the request until the first token.
            return
        marks.abort_sent = True
        self.spawn(self._abort(context))

    async def _abort(self, context: Context) -> None:
        try:
            await self.engine.abort(context)
        except Exception:
            logger.exception("engine abort failed for request %s", context.id())

    def generate(self, request: dict[str, Any], context: Context) -> AsyncIterator[dict]:
        """Stream an engine's chunks under the contract's rules.

        Token engines: ends after every expected choice (``sampling_options.n``) produced its
        terminal. Raw engines: ends when the engine's stream ends. Raises
        :class:`PenstockError` for engine failures (once iterated, as every other error).

        A single-choice request is one generator between the engine's task and the caller
        (each layer costs every chunk a resumption); a fanned-out one merges its choices
        under one admission slot.
        """
        expected = 1
        if not self.is_raw:
            n = (request.get("sampling_options") or {}).get("n") or 1
            expected = n if isinstance(n, int) and n > 0 else 1
        if expected > 1 and not self.multi_choice:
            return self._fanned_out(request, context, expected)
        return self._generate_one(request, context, expected, admit=True)

    async def _admit(self, request: dict[str, Any], context: Context) -> AdmissionGate | None:
        """Take the request's admission slot (none for a canary); :meth:`_release` gives
        back what this returns."""
        if self.state is not EngineState.RUNNING:
            raise EngineError("engine is not running")
        gate = None if is_probe(request) else self.admission
        if gate is not None:
            await gate.acquire()
            context.current_span().add_event("admitted")
        self._inflight += 1
        self._last_activity = time.monotonic()
        return gate

    def _release(self, gate: AdmissionGate | None) -> None:
        self._inflight -= 1
        self._last_activity = time.monotonic()
        if gate is not None:
            gate.release()

    async def _fanned_out(
        self, request: dict[str, Any], context: Context, n: int
    ) -> AsyncGenerator[dict, None]:
        """``n`` choices from an engine that yields one, under one admission slot."""
        gate = await self._admit(request, context)
        try:
            # The engine never sees the parent's context: nothing to abort for it.
            self._marks_of(context).finished = True
            stream = fan_out(
                request,
                context,
                n,
                run_choice=lambda choice, child: self._generate_one(choice, child, 1),
                spawn=self.spawn,
                cancel=self.cancel,
            )
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                await stream.aclose()
        finally:
            self._release(gate)

    async def _generate_one(
        self, request: dict[str, Any], context: Context, expected: int, *, admit: bool = False
    ) -> AsyncGenerator[dict, None]:
        """One engine request, its generator run by its own task (see the module
        docstring: a consumer going away must not reach the engine as ``CancelledError``),
        or by the caller's for a cancel-safe engine. With ``admit``, it also holds the
        request's admission slot until it ends.

        The loop is every chunk's path, so it calls nothing of its own per chunk; the
        steps taken once a request are the methods it calls."""
        gate = await self._admit(request, context) if admit else None
        try:
            marks = self._marks_of(context)
            marks.active = True
            raw = self.is_raw
            top_k = None if raw else _top_k_of(request)
            # The choices that ended: a one-choice request allocates no set (it ends with its
            # first terminal).
            finished = _NONE_ENDED
            agen: AsyncGenerator[dict, None] = self.engine.generate(request, context)  # type: ignore[attr-defined]
            inline = self.cancel_safe
            next_chunk = agen.__anext__
            queue = None if inline else Handoff()
            # Not one of the host's background tasks: this generator holds it, and hands it
            # to the task that winds the request down (a done callback less a request).
            pumping = None if inline else asyncio.get_running_loop().create_task(pump(agen, queue))
            completed = False
            first_token_seen = context.first_token_seen
            try:
                while True:
                    if inline:
                        try:
                            chunk = await next_chunk()
                        except StopAsyncIteration:
                            break
                    else:
                        while (chunk := queue.take_chunk()) is None:
                            await queue.handed_over()
                        if chunk is END:
                            break
                    if raw:
                        yield chunk
                        continue
                    if not isinstance(chunk, dict):
                        raise EngineError("engine yielded a non-object chunk")
                    index = chunk.get("index", 0)
                    if index in finished or not isinstance(index, int) or index >= expected:
                        log_contract_violation(context, f"chunk for choice {index!r} dropped")
                        continue
                    if not first_token_seen and chunk.get("token_ids"):
                        first_token_seen = True
                        context.notify_first_token()
                    if top_k is not None and chunk.get("top_logprobs"):
                        chunk["top_logprobs"] = _trimmed(chunk["top_logprobs"], top_k)
                    if chunk.get("finish_reason"):
                        finished = finished | {index}
                        if len(finished) == expected:
                            completed = True
                            self._end_at_terminal(context, pumping, queue)
                            yield chunk
                            return
                    yield chunk
                self._end_of_stream(context, finished, expected)
                completed = True
            except Exception as exc:
                raise self._engine_failure(exc, context)  # noqa: B904 (it carries its cause)
            finally:
                marks.active = False
                await self._close_stream(agen, context, completed, pumping, queue)
        finally:
            if admit:
                self._release(gate)

    def _end_at_terminal(
        self, context: Context, pumping: asyncio.Task[None] | None, queue: Handoff | None
    ) -> None:
        """Every choice's terminal is in: the request ended (an engine task is then read
        to its end, any chunk after the terminals dropped)."""
        self._end(context)
        if pumping is not None and queue is not None:
            self.spawn(drain_after_terminal(pumping, queue, context))

    def _end_of_stream(self, context: Context, finished: frozenset[int], expected: int) -> None:
        """The engine's stream ended: a raw engine's request with it; a token engine's
        owed a terminal for every choice first."""
        if not self.is_raw:
            missing = sorted(set(range(expected)) - finished)
            raise EngineError(f"engine ended the stream without a terminal for {missing}")
        self._end(context)

    def _engine_failure(self, exc: Exception, context: Context) -> PenstockError:
        """What the client sees of an exception in the request's stream."""
        if isinstance(exc, PenstockError):
            return exc
        overload = self.admission.overload_status if self.admission is not None else 529
        error = engine_exception_to_error(exc, overload)
        error.__cause__ = exc
        if error.status_code < 500:
            # The client's input: one line, no traceback.
            logger.warning("request %s refused: %s", context.id(), error.message)
        else:
            logger.exception("generate failed for request %s", context.id(), exc_info=exc)
        return error

    async def _close_stream(
        self,
        agen: AsyncGenerator[dict, None],
        context: Context,
        completed: bool,
        pumping: asyncio.Task[None] | None,
        queue: Handoff | None,
    ) -> None:
        """The consumer left the request's stream. One that did not complete is marked
        killed first, then aborted after its engine stream ended: a cancel-safe engine's
        ``finally`` runs now, in this task (a no-op once it has ended); an engine task is
        left to wind down."""
        if pumping is None:
            if not completed:
                context.kill()
            # try/except, not contextlib.suppress: once a request, it costs three calls less.
            try:
                await agen.aclose()
            except Exception:
                logger.debug("closing the stream of request %s failed", context.id(), exc_info=True)
            if not completed:
                self._schedule_abort(context)
        elif not completed and queue is not None:
            context.kill()
            self.spawn(wind_down(pumping, queue, context, queue.ended, self._schedule_abort))

    def _end(self, context: Context) -> None:
        """The request ended with its terminal: abort only if it had been stopped."""
        if context.is_stopped():
            self._schedule_abort(context)
        else:
            self._marks_of(context).finished = True

    # -- health canary ----------------------------------------------------------------

    async def check_health(self) -> HealthStatus:
        """Send the canary through ``generate`` once and record the outcome."""
        payload = self.health_check_payload
        if payload is None:
            return self.health
        context = Context(f"health-{secrets.token_hex(4)}")
        reason: str | None = None
        try:
            async with asyncio.timeout(self.monitor.check_timeout):
                terminal: dict | None = None
                async for chunk in self.generate(dict(payload), context):
                    terminal = chunk
                if terminal is not None and terminal.get("finish_reason") == "error":
                    reason = "health canary finished with an error"
        except TimeoutError:
            self.cancel(context)
            reason = f"health canary timed out after {self.monitor.check_timeout:g}s"
        except PenstockError as exc:
            reason = f"health canary failed: {exc.message}"
        except Exception as exc:
            reason = f"health canary failed: {exc}"
        self.health = HealthStatus(reason is None, reason, time.time())
        if reason is not None:
            logger.warning("engine unhealthy: %s", reason)
        return self.health

    def start_monitor(self) -> None:
        if self.health_check_payload is not None and self._monitor_task is None:
            self._monitor_task = asyncio.get_running_loop().create_task(self._monitor_loop())

    async def stop_monitor(self) -> None:
        task, self._monitor_task = self._monitor_task, None
        await cancel_and_wait(task)

    async def _monitor_loop(self) -> None:
        interval = max(self.monitor.interval, 0.05)
        while True:
            await asyncio.sleep(interval)
            idle_for = time.monotonic() - self._last_activity
            if self._inflight == 0 and idle_for >= interval:
                await self.check_health()
