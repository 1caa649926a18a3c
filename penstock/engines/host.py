"""The in-process worker that drives one engine through the contract.

:class:`EngineHost` owns the guarantees an engine may rely on (see
:mod:`penstock.engines.contract`) and the ones the gateway relies on in return:

* ``start``/``cleanup`` are serialized; cleanup runs once after any ``start`` attempt and
  never without one;
* every request stream ends in exactly one terminal per choice, or an :class:`EngineError`;
  chunks after a terminal are logged as contract violations and dropped;
* ``abort(context)`` runs at most once per request, only when it was cancelled or its
  consumer went away before the terminal;
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
from penstock.engines.contract import BaseEngine, EngineConfig, model_input_of
from penstock.engines.health import HEALTH_CHECK_KEY, EngineHealthMonitorConfig, is_probe
from penstock.errors import EngineError, InvalidRequestError, PenstockError

logger = logging.getLogger(__name__)

_DRAIN_AFTER_TERMINAL_S = 5.0


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


@dataclass
class _RequestMarks:
    """What the host has done for one request, so ``abort`` runs at most once."""

    abort_sent: bool = False
    finished: bool = False


def engine_exception_to_error(exc: BaseException) -> PenstockError:
    """Map an exception raised by ``generate`` to what the client sees.

    ``ValueError`` means the engine rejected the request's arguments (400, message kept);
    objects carrying an int ``status`` (or ``code``) and a ``message`` keep their status
    class; anything else is an internal error whose details stay in the log.
    """
    if isinstance(exc, PenstockError):
        return exc
    status = getattr(exc, "status", None)
    if not isinstance(status, int) or isinstance(status, bool):
        status = getattr(exc, "code", None)
    message = getattr(exc, "message", None)
    if isinstance(status, int) and not isinstance(status, bool) and isinstance(message, str):
        if 400 <= status < 500:
            error: PenstockError = InvalidRequestError(message)
            error.status_code = status
            return error
        return EngineError("Internal server error")
    if isinstance(exc, ValueError):
        return InvalidRequestError(str(exc) or type(exc).__name__)
    return EngineError("Internal server error")


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
        """Cancel a request on the caller's behalf (graceful stop, then ``abort``)."""
        context.stop_generating()
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
        marks.abort_sent = True
        self.spawn(self._abort(context))

    async def _abort(self, context: Context) -> None:
        try:
            await self.engine.abort(context)
        except Exception:
            logger.exception("engine abort failed for request %s", context.id())

    async def generate(self, request: dict[str, Any], context: Context) -> AsyncIterator[dict]:
        """Stream an engine's chunks under the contract's rules.

        Token engines: ends after every expected choice (``sampling_options.n``) produced its
        terminal. Raw engines: ends when the engine's stream ends. Raises
        :class:`PenstockError` for engine failures.
        """
        if self.state is not EngineState.RUNNING:
            raise EngineError("engine is not running")
        gate = None if is_probe(request) else self.admission
        if gate is not None:
            await gate.acquire()
            context.current_span().add_event("admitted")
        self._inflight += 1
        self._last_activity = time.monotonic()
        raw = self.is_raw
        expected = 1
        if not raw:
            n = (request.get("sampling_options") or {}).get("n") or 1
            expected = n if isinstance(n, int) and n > 0 else 1
        finished: set[int] = set()
        agen: AsyncGenerator[dict, None] = self.engine.generate(request, context)  # type: ignore[attr-defined]
        completed = False
        try:
            async for chunk in agen:
                if raw:
                    yield chunk
                    continue
                if not isinstance(chunk, dict):
                    raise EngineError("engine yielded a non-object chunk")
                index = chunk.get("index", 0)
                if index in finished or not isinstance(index, int) or index >= expected:
                    self._contract_violation(context, f"chunk for choice {index!r} dropped")
                    continue
                if chunk.get("token_ids") and not context.first_token_seen:
                    context.notify_first_token()
                if chunk.get("finish_reason"):
                    finished.add(index)
                    if len(finished) == expected:
                        self._marks_of(context).finished = True
                        completed = True
                        yield chunk
                        self.spawn(self._drain_after_terminal(agen, context))
                        return
                yield chunk
            if not raw:
                missing = sorted(set(range(expected)) - finished)
                raise EngineError(f"engine ended the stream without a terminal for {missing}")
            self._marks_of(context).finished = True
            completed = True
        except (asyncio.CancelledError, GeneratorExit):
            context.kill()
            self._schedule_abort(context)
            raise
        except PenstockError:
            raise
        except Exception as exc:
            logger.exception("generate failed for request %s", context.id())
            raise engine_exception_to_error(exc) from exc
        finally:
            self._inflight -= 1
            self._last_activity = time.monotonic()
            if gate is not None:
                gate.release()
            if not completed and not context.is_stopped():
                context.kill()
                self._schedule_abort(context)

    def _contract_violation(self, context: Context, what: str) -> None:
        logger.error("engine contract violation (request %s): %s", context.id(), what)

    async def _drain_after_terminal(
        self, agen: AsyncGenerator[dict, None], context: Context
    ) -> None:
        try:
            async with asyncio.timeout(_DRAIN_AFTER_TERMINAL_S):
                async for _ in agen:
                    self._contract_violation(context, "chunk after the terminal dropped")
        except TimeoutError:
            self._contract_violation(context, "stream kept running after the terminal")
        except Exception:
            logger.exception("engine raised after the terminal (request %s)", context.id())
        finally:
            with contextlib.suppress(Exception):
                await agen.aclose()

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
