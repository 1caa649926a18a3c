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
  ``_CANCEL_GRACE_S``, else its stream is closed); then ``abort(context)`` runs once. A
  natural completion never looks cancelled and never aborts;
* an engine that advertises ``CANCEL_SAFE_RUNTIME_KEY`` gives up its own task: its
  ``generate`` runs in the consumer's task, with no hand-off per chunk. A consumer going
  away reaches it at once, as ``CancelledError`` at the ``await`` it is in or as the
  stream being closed at its ``yield``; its stream is closed after its last terminal. A
  cancel (a stop mark) and the single ``abort`` are as for any engine;
* decode role (``disaggregation_mode`` decode): ``abort`` waits for the request's first
  token and is skipped when the request ends before one;
* ``n`` > 1 on an engine that does not advertise ``MULTI_CHOICE_RUNTIME_KEY`` runs as n
  single-choice requests (child contexts, seeds ``seed + i``) merged as choices; stopping
  the request stops all of them, each aborted once; together they take one admission
  slot;
* ``top_logprobs``: at most the requested k per position (Dynamo engines report the
  chosen token plus k alternatives; the k most likely are kept);
* engine exceptions become client statuses as Dynamo maps them
  (:func:`engine_exception_to_error`);
* every optional method an engine lacks gets its documented default
  (:func:`~penstock.engines.contract.fill_optional_hooks`);
* an idle canary (``health_check_payload`` or the operator override) probes ``generate``
  on the :class:`EngineHealthMonitorConfig` cadence and drives :attr:`health`.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from penstock.engines.health import HEALTH_CHECK_KEY, EngineHealthMonitorConfig, is_probe
from penstock.errors import (
    ClientClosedRequest,
    EngineError,
    GatewayTimeoutError,
    InvalidRequestError,
    OverloadedError,
    PenstockError,
    ServiceUnavailableError,
)

logger = logging.getLogger(__name__)

_DRAIN_AFTER_TERMINAL_S = 5.0
# How long a cancelled request's engine stream may run on before it is closed (the
# conformance kit's bound for observing a cancellation).
_CANCEL_GRACE_S = 2.0
_END = object()
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


_CLIENT_ERRORS = ("InvalidArgument",)
_TIMEOUTS = ("ConnectionTimeout",)
_UNAVAILABLE = ("EngineShutdown", "CannotConnect", "Disconnected", "WorkerUnavailable")
_OVERLOADED = ("RouterQueueLimitExceeded",)
_CANCELLED = ("Cancelled",)


def _dynamo_kind(exc: BaseException) -> str | None:
    """The ``dynamo.llm.exceptions`` class ``exc`` is (matched by module and name, so the
    gateway needs no Dynamo import), or None."""
    for base in type(exc).__mro__:
        if base.__module__.startswith("dynamo.") and base.__name__ != "DynamoException":
            if base.__name__ in (
                *_CLIENT_ERRORS,
                *_TIMEOUTS,
                *_UNAVAILABLE,
                *_OVERLOADED,
                *_CANCELLED,
            ):
                return base.__name__
    return None


def _int_status(exc: BaseException) -> int | None:
    for name in ("status", "code"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def engine_exception_to_error(exc: BaseException, overload_status: int = 529) -> PenstockError:
    """Map an exception raised by ``generate`` to what the client sees.

    As Dynamo maps them: ``InvalidArgument``, ``ValueError`` and ``TypeError`` are the
    client's fault (400, message kept); an object with an int ``status`` (or ``code``, as
    ``dynamo.llm.exceptions.HttpError``) and a str ``message`` keeps a 4xx status and
    message, and a 503 or overload status; ``TimeoutError`` / ``ConnectionTimeout`` are
    504; ``EngineShutdown``, ``CannotConnect``, ``Disconnected``, ``WorkerUnavailable`` and
    connection errors are 503; ``RouterQueueLimitExceeded`` is the overload status;
    ``Cancelled`` is 499. Everything else is a 500 whose details stay in the log.
    """
    if isinstance(exc, PenstockError):
        return exc
    kind = _dynamo_kind(exc)
    status = _int_status(exc)
    message = getattr(exc, "message", None)
    if kind is None and status is not None and isinstance(message, str):
        if 400 <= status < 500:
            error: PenstockError = InvalidRequestError(message)
            error.status_code = status
            return error
        if status == 503:
            return ServiceUnavailableError("Service temporarily unavailable")
        if status in (429, 529, overload_status):
            return _overloaded(overload_status)
        return EngineError("Internal server error")
    if kind in _CLIENT_ERRORS or isinstance(exc, ValueError | TypeError):
        return InvalidRequestError(str(exc) or type(exc).__name__)
    if kind in _TIMEOUTS or isinstance(exc, TimeoutError):
        return GatewayTimeoutError("The engine timed out")
    if kind in _UNAVAILABLE or isinstance(exc, ConnectionError | GeneratorExit):
        return ServiceUnavailableError("Service temporarily unavailable")
    if kind in _OVERLOADED:
        return _overloaded(overload_status)
    if kind in _CANCELLED or isinstance(exc, asyncio.CancelledError):
        return ClientClosedRequest("Request cancelled")
    return EngineError("Internal server error")


def _overloaded(status: int) -> PenstockError:
    error = OverloadedError("Service temporarily overloaded")
    error.status_code = status
    return error


def _top(alternatives: list[dict[str, Any]] | None, k: int) -> list[dict[str, Any]]:
    """The ``k`` most likely alternatives of one position: Dynamo engines report the
    chosen token plus k alternatives, OpenAI's ``top_logprobs`` holds exactly k."""
    if not alternatives or len(alternatives) <= k:
        return alternatives or []
    ranked = sorted(alternatives, key=lambda alt: alt.get("logprob", float("-inf")), reverse=True)
    return ranked[:k]


def _choice_request(request: dict[str, Any], index: int) -> dict[str, Any]:
    """Choice ``index`` of a fanned-out request: ``n`` = 1 and, when a seed was given,
    ``seed + index`` (so choices differ yet replay)."""
    sampling = dict(request.get("sampling_options") or {})
    sampling["n"] = 1
    seed = sampling.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        sampling["seed"] = seed + index
    return {**request, "sampling_options": sampling}


class _Handoff:
    """The one-item channel from a request's engine task to its consumer: what
    ``asyncio.Queue(maxsize=1)`` does for one producer and one consumer, without its three
    deques (~2 KB a request) and its bookkeeping on every chunk."""

    __slots__ = ("_full", "_getter", "_item", "_loop", "_putter")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._item: tuple[Any, BaseException | None] | None = None
        self._full = False
        self._getter: asyncio.Future[None] | None = None
        self._putter: asyncio.Future[None] | None = None

    async def put(self, item: tuple[Any, BaseException | None]) -> None:
        while self._full:
            self._putter = self._loop.create_future()
            try:
                await self._putter
            finally:
                self._putter = None
        self.put_nowait(item)

    def put_nowait(self, item: tuple[Any, BaseException | None]) -> bool:
        """Hand ``item`` over if the slot is free (no coroutine to await); False if not."""
        if self._full:
            return False
        self._item = item
        self._full = True
        _wake(self._getter)
        return True

    def take(self) -> tuple[Any, BaseException | None] | None:
        """The item handed over, freeing the slot; None if there is none yet."""
        if not self._full:
            return None
        item = self._item
        self._item = None
        self._full = False
        _wake(self._putter)
        return item

    def handed_over(self) -> asyncio.Future[None]:
        """A future done once an item is handed over: awaited as is, with no coroutine
        around it (the consumer's wait is once a chunk)."""
        getter = self._getter = self._loop.create_future()
        return getter

    async def get(self) -> tuple[Any, BaseException | None]:
        while (item := self.take()) is None:
            await self.handed_over()
        return item


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


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
        configured = getattr(self.worker_config, "served_model_name", None)
        if configured:
            return str(configured)
        if self.engine_config is None:
            raise RuntimeError("engine not started")
        return self.engine_config.served_model_name or self.engine_config.model

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
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

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
            return self._admitted(request, context, self._fan_out(request, context, expected))
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

    async def _admitted(
        self, request: dict[str, Any], context: Context, stream: AsyncGenerator[dict, None]
    ) -> AsyncGenerator[dict, None]:
        gate = await self._admit(request, context)
        try:
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
        request's admission slot until it ends."""
        gate = await self._admit(request, context) if admit else None
        try:
            marks = self._marks_of(context)
            marks.active = True
            raw = self.is_raw
            top_k = None if raw else (request.get("output_options") or {}).get("logprobs")
            if not isinstance(top_k, int) or isinstance(top_k, bool):
                top_k = None
            # The choices that ended: a one-choice request allocates no set (it ends with its
            # first terminal).
            finished = _NONE_ENDED
            agen: AsyncGenerator[dict, None] = self.engine.generate(request, context)  # type: ignore[attr-defined]
            inline = self.cancel_safe
            if inline:
                next_chunk = agen.__anext__
            else:
                queue = _Handoff()
                # Not one of the host's background tasks: this generator holds it, and
                # hands it to the task that winds the request down (a done callback less a
                # request).
                pump = asyncio.get_running_loop().create_task(self._pump(agen, queue))
            completed = ended = False
            first_token_seen = context.first_token_seen
            try:
                while True:
                    if inline:
                        try:
                            chunk = await next_chunk()
                        except StopAsyncIteration:
                            ended = True
                            break
                    else:
                        while (handed := queue.take()) is None:
                            await queue.handed_over()
                        chunk, error = handed
                        ended = chunk is _END
                        if error is not None:
                            raise error
                        if ended:
                            break
                    if raw:
                        yield chunk
                        continue
                    if not isinstance(chunk, dict):
                        raise EngineError("engine yielded a non-object chunk")
                    index = chunk.get("index", 0)
                    if index in finished or not isinstance(index, int) or index >= expected:
                        self._contract_violation(context, f"chunk for choice {index!r} dropped")
                        continue
                    if not first_token_seen and chunk.get("token_ids"):
                        first_token_seen = True
                        context.notify_first_token()
                    if top_k is not None and chunk.get("top_logprobs"):
                        chunk["top_logprobs"] = [
                            _top(alts, top_k) for alts in chunk["top_logprobs"]
                        ]
                    if chunk.get("finish_reason"):
                        finished = finished | {index}
                        if len(finished) == expected:
                            completed = True
                            self._end(context)
                            if not inline:
                                self.spawn(self._drain_after_terminal(pump, queue, context))
                            yield chunk
                            return
                    yield chunk
                if not raw:
                    missing = sorted(set(range(expected)) - finished)
                    raise EngineError(f"engine ended the stream without a terminal for {missing}")
                completed = True
                self._end(context)
            except PenstockError:
                raise
            except Exception as exc:
                logger.exception("generate failed for request %s", context.id())
                overload = self.admission.overload_status if self.admission is not None else 529
                raise engine_exception_to_error(exc, overload) from exc
            finally:
                marks.active = False
                if inline:
                    if not completed:
                        context.kill()
                    # Its ``finally`` runs now, in this task; a no-op once it has ended.
                    with contextlib.suppress(Exception):
                        await agen.aclose()
                    if not completed:
                        self._schedule_abort(context)
                elif not completed:
                    # The consumer went away or the stream failed: mark it first, then let
                    # the engine wind down before it is aborted.
                    context.kill()
                    self.spawn(self._wind_down(pump, queue, context, ended))
        finally:
            if admit:
                self._release(gate)

    def _end(self, context: Context) -> None:
        """The request ended with its terminal: abort only if it had been stopped."""
        if context.is_stopped():
            self._schedule_abort(context)
        else:
            self._marks_of(context).finished = True

    async def _pump(
        self,
        agen: AsyncGenerator[dict, None],
        queue: _Handoff,
    ) -> None:
        try:
            async for item in agen:
                # The consumer has nearly always taken the previous chunk by now.
                if not queue.put_nowait((item, None)):
                    await queue.put((item, None))
        except Exception as exc:
            await queue.put((_END, exc))
            return
        finally:
            with contextlib.suppress(Exception):
                await agen.aclose()
        await queue.put((_END, None))

    async def _wind_down(
        self,
        pump: asyncio.Task[None],
        queue: _Handoff,
        context: Context,
        ended: bool,
    ) -> None:
        """Read a killed request's stream to its end (bounded), then abort it once."""
        try:
            async with asyncio.timeout(_CANCEL_GRACE_S):
                while not ended:
                    chunk, _ = await queue.get()
                    ended = chunk is _END
                    if isinstance(chunk, dict) and chunk.get("token_ids"):
                        context.notify_first_token()
        except TimeoutError:
            logger.warning(
                "engine kept request %s running %gs after its cancellation; closing it",
                context.id(),
                _CANCEL_GRACE_S,
            )
        finally:
            pump.cancel()
            self._schedule_abort(context)

    async def _fan_out(
        self, request: dict[str, Any], parent: Context, n: int
    ) -> AsyncGenerator[dict, None]:
        """``n`` choices from an engine that yields one: n requests, merged as choices."""
        self._marks_of(parent).finished = True
        children = [parent.detached(f"{parent.id()}-{i}") for i in range(n)]
        queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()

        async def run(index: int) -> None:
            stream = self._generate_one(_choice_request(request, index), children[index], 1)
            try:
                async for chunk in stream:
                    chunk["index"] = index
                    await queue.put((chunk, None))
            except Exception as exc:
                await queue.put((_END, exc))
                return
            finally:
                await stream.aclose()
            await queue.put((_END, None))

        async def propagate_stop() -> None:
            await parent.async_killed_or_stopped()
            for child in children:
                if parent.is_killed():
                    child.kill()
                self.cancel(child)

        watcher = self.spawn(propagate_stop())
        runs = [self.spawn(run(i)) for i in range(n)]
        remaining = n
        try:
            while remaining:
                chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is _END:
                    remaining -= 1
                    continue
                yield chunk
        finally:
            watcher.cancel()
            for task in runs:
                task.cancel()

    def _contract_violation(self, context: Context, what: str) -> None:
        logger.error("engine contract violation (request %s): %s", context.id(), what)

    async def _drain_after_terminal(
        self,
        pump: asyncio.Task[None],
        queue: _Handoff,
        context: Context,
    ) -> None:
        try:
            async with asyncio.timeout(_DRAIN_AFTER_TERMINAL_S):
                while True:
                    chunk, error = await queue.get()
                    if error is not None:
                        logger.error(
                            "engine raised after the terminal (request %s): %r",
                            context.id(),
                            error,
                        )
                        return
                    if chunk is _END:
                        return
                    self._contract_violation(context, "chunk after the terminal dropped")
        except TimeoutError:
            self._contract_violation(context, "stream kept running after the terminal")
        finally:
            pump.cancel()

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
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _monitor_loop(self) -> None:
        interval = max(self.monitor.interval, 0.05)
        while True:
            await asyncio.sleep(interval)
            idle_for = time.monotonic() - self._last_activity
            if self._inflight == 0 and idle_for >= interval:
                await self.check_health()
