"""The admin state machine every admin dialect drives: one engine, one state.

States: ``serving``; ``paused`` (with the pause mode); ``sleeping`` (with the released
tags); ``updating`` (while a weight update runs, with its target version); ``draining``
(the process is shutting down). Sleep may start from serving or paused, and a full wake
returns to where it started.

Rules, whatever route or dialect asked:

* state-changing operations are serialized (one lock), and none holds it across an
  unbounded wait: waiting for the lock and the engine calls of one operation share one
  deadline, ``--admin-timeout-s`` (``PENSTOCK_ADMIN_TIMEOUT_S``, default 30 s). Past it
  the caller gets a 409 naming the state: ``admin_busy`` when another operation kept the
  lock, ``admin_timeout`` when the engine call overran; the overrunning call is cancelled
  and a pause or sleep is undone (the engine resumed or woken back), so the state is the
  one before the call and requests held meanwhile run;
* repeating an operation in the state it leads to is a no-op (``changed=False``);
* an invalid transition raises :class:`ConflictError` (409) carrying the current state;
* weight updates need ``paused``: called while serving they get a 409 saying to pause;
  that is every method (disk, distributed broadcast, tensors, NIXL), each publishing its
  ``weight_version`` only once it succeeded (an engine whose update pauses and resumes by
  itself, ``pauses_for_updates``, as a Ray fleet's transaction does, may be updated while
  serving too). An update asked for ``between_steps`` (SGLang's tensor push, which needs
  no pause there) is applied while serving too: the engine freezes its running requests
  after the step in progress (a ``keep`` pause), the whole update lands, and they
  continue on the new weights; while sleeping with the weights awake (only the KV cache
  released) it writes the weights, and the engine stays asleep. ``last_update`` (in
  ``describe``, so in ``/health``) says how the last one was applied;
* an operation that fails (the engine refuses or raises) restores the previous state,
  and the engine keeps its previous weights;
* sleeping while paused in mode ``keep``: the requests the pause froze mid-generation
  are parked, not running, so the sleep's mode decides their fate as it does for running
  ones in vLLM: ``abort`` ends them (``finish_reason`` ``"abort"``), ``keep`` and ``wait``
  leave them frozen (``wait`` has nothing running to wait for, and waiting on frozen
  requests would never end) and they continue after ``wake_up`` and ``resume``. This is
  SGLang's ``release_memory_occupation`` after a ``retract``/``in_place`` pause too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from penstock import tracing
from penstock.engines.controls import (
    ABORT_REQUEST,
    GET_WEIGHT_VERSION,
    IS_PAUSED,
    IS_SLEEPING,
    PAUSE,
    RESUME,
    SLEEP,
    SLEEP_TAGS,
    WAKE_UP,
    default_sleep_tags,
)
from penstock.errors import (
    ConflictError,
    InternalServerError,
    InvalidRequestError,
    PenstockError,
    ServiceUnavailableError,
)
from penstock.metrics.admin import AdminMetrics
from penstock.rl.fields import tensor_update_body
from penstock.settings import DEFAULT_ADMIN_TIMEOUT_S

logger = logging.getLogger(__name__)

# Controls that only read state or end individual requests: no need to queue them behind
# a long operation (a trainer may abort stragglers while a wait-mode pause drains).
UNSERIALIZED_CONTROLS = frozenset({IS_PAUSED, IS_SLEEPING, GET_WEIGHT_VERSION})
WEIGHT_UPDATES_PREFIX = "update_weights_"
_WAIT_HINT = ": in-flight requests were still running; use mode abort or keep, or abort them first"


@dataclass(frozen=True)
class Outcome:
    """What an admin operation did: ``changed`` is False for an idempotent repeat."""

    changed: bool
    engine: dict[str, Any]


def aborted_count(result: dict[str, Any]) -> int:
    """How many requests an engine's answer says it ended (``aborted``: ids or a count)."""
    aborted = result.get("aborted")
    if isinstance(aborted, list):
        return len(aborted)
    if isinstance(aborted, int) and not isinstance(aborted, bool):
        return aborted
    return 0


def failure_reason(exc: BaseException) -> str:
    """The ``reason`` label of a failed weight update."""
    if isinstance(exc, ConflictError) and exc.code == "admin_timeout":
        return "timeout"
    if isinstance(exc, PenstockError) and exc.status_code < 500:
        return "rejected"
    return "error"


def is_error_response(result: dict[str, Any]) -> bool:
    status = result.get("status")
    return (isinstance(status, str) and status.lower() == "error") or result.get("success") is False


class AdminStateMachine:
    """Owns the admin state and the weight version; talks to the engine's controls."""

    def __init__(
        self,
        engine: Any,
        *,
        is_draining: Callable[[], bool] = lambda: False,
        publish_version: Callable[[str | None], None] = lambda version: None,
        weight_version: str | None = None,
        timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S,
        metrics: AdminMetrics | None = None,
        trust_weight_payloads: bool = False,
    ) -> None:
        self.engine = engine
        self.trust_weight_payloads = trust_weight_payloads
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._is_draining = is_draining
        self._publish_version = publish_version
        self._lock = asyncio.Lock()
        # Named in the 409 of an operation that could not get the lock in time.
        self._holder: str | None = None
        self.pause_mode: str | None = None
        self.sleep_tags: frozenset[str] = frozenset()
        self.sleep_level: int | None = None
        # What the engine's sleep answer says it freed, with its reason, where it says:
        # an engine that holds generation but frees nothing (vLLM on the CPU) says so here.
        self.sleep_freed: dict[str, Any] | None = None
        self.updating: str | None = None
        self.update_target: str | None = None
        self.last_update: dict[str, Any] | None = None
        self.weight_version = weight_version
        self.version_declared = weight_version is not None
        self.since = time.time()

    # -- what the gateway reads -------------------------------------------------------

    @property
    def name(self) -> str:
        if self._is_draining():
            return "draining"
        if self.updating is not None:
            return "updating"
        if self.sleep_tags:
            return "sleeping"
        if self.pause_mode is not None:
            return "paused"
        return "serving"

    @property
    def engine_pauses_for_updates(self) -> bool:
        """An engine that pauses, updates and resumes in one update call (a Ray fleet's
        transaction) may be updated while serving."""
        return getattr(self.engine, "pauses_for_updates", False) is True

    @property
    def is_paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleep_tags)

    def describe(self) -> dict[str, Any]:
        described = {
            "state": self.name,
            "mode": self.pause_mode,
            "tags": sorted(self.sleep_tags),
            "sleep_level": self.sleep_level,
            "updating": self.updating,
            "target_version": self.update_target,
            "last_update": self.last_update,
            "weight_version": self.weight_version,
            "version_declared": self.version_declared,
            "since": self.since,
        }
        if self.sleep_freed is not None:
            described.update(self.sleep_freed)
        return described

    def conflict(self, message: str, code: str = "invalid_state_transition") -> ConflictError:
        return ConflictError(
            message,
            code=code,
            extra={"state": self.name, "admin": self.describe()},
        )

    # -- engine calls -----------------------------------------------------------------

    def supports(self, kind: str, name: str) -> bool:
        if kind == "control":
            return name in self.engine.supported_controls()
        return name in self.engine.supported_updates()

    def require_support(self, kind: str, name: str) -> None:
        if self.supports(kind, name):
            return
        offered = (
            self.engine.supported_controls()
            if kind == "control"
            else self.engine.supported_updates()
        )
        raise InvalidRequestError(
            f"this engine does not support the {kind} '{name}' "
            f"(it offers: {', '.join(sorted(offered)) or 'none'})",
            code="unsupported_by_engine",
        )

    async def call_engine(
        self, kind: str, name: str, body: dict[str, Any], *, param: str | None = None
    ) -> dict[str, Any]:
        """Run an engine control/update; refusals become 400 with its message (on ``param``)."""
        self.require_support(kind, name)
        call = self.engine.engine_control if kind == "control" else self.engine.engine_update
        try:
            result = await call(name, body)
        except PenstockError:
            raise
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(
                f"{name}: {exc}", param=param, code="engine_rejected"
            ) from exc
        except Exception as exc:
            logger.exception("engine %s %s failed", kind, name)
            raise InternalServerError(f"engine {kind} '{name}' failed") from exc
        if result is None:
            return {"status": "ok"}
        if not isinstance(result, dict):
            raise InternalServerError(f"engine {kind} '{name}' returned a non-object")
        if is_error_response(result):
            message = result.get("message") or f"engine {kind} '{name}' failed"
            raise InvalidRequestError(str(message), param=param, code="engine_rejected")
        return result

    def _refuse_if_draining(self) -> None:
        if self._is_draining():
            raise ServiceUnavailableError("The server is shutting down")

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout_s

    @contextlib.asynccontextmanager
    async def _exclusive(self, operation: str) -> AsyncIterator[float]:
        """Hold the admin lock for ``operation``; yields the deadline it must finish by."""
        deadline = self._deadline()
        found = self._holder
        try:
            async with asyncio.timeout_at(deadline):
                await self._lock.acquire()
        except TimeoutError:
            busy = f"'{found}'" if found else "another operation"
            raise self.conflict(
                f"{operation}: the admin plane stayed busy with {busy} for "
                f"{self.timeout_s:g}s (--admin-timeout-s); retry",
                code="admin_busy",
            ) from None
        self._holder = operation
        tracing.annotate("penstock.admin.operation", operation)
        try:
            self._refuse_if_draining()
            yield deadline
        finally:
            self._holder = None
            self._lock.release()

    async def _bounded_call(
        self,
        deadline: float,
        operation: str,
        kind: str,
        name: str,
        body: dict[str, Any],
        *,
        param: str | None = None,
        undo: Callable[[], Awaitable[None]] | None = None,
        hint: str = "",
    ) -> dict[str, Any]:
        """``call_engine`` cancelled at ``deadline``; ``undo`` then restores the state from
        before the call, the engine's included, and the 409 names it."""
        try:
            async with asyncio.timeout_at(deadline):
                return await self.call_engine(kind, name, body, param=param)
        except TimeoutError:
            if undo is not None:
                await undo()
            raise self.conflict(
                f"{operation} did not finish within {self.timeout_s:g}s (--admin-timeout-s) "
                f"and was cancelled; the state stays '{self.name}'{hint}",
                code="admin_timeout",
            ) from None

    async def _restore(self, control: str, body: dict[str, Any]) -> None:
        """Undo a cancelled pause or sleep; a failure is logged, the 409 goes out anyway."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.call_engine("control", control, body)
        except Exception:
            logger.exception("engine %s after a timed-out admin operation failed", control)

    def _set_version(self, version: str | None) -> None:
        if self.metrics is not None and version != self.weight_version:
            self.metrics.version_changed()
        self.weight_version = version
        self.version_declared = version is not None
        self._publish_version(version)

    def _touch(self) -> None:
        self.since = time.time()

    def _record(self, operation: str, started: float, result: dict[str, Any] | None = None) -> None:
        if self.metrics is None:
            return
        self.metrics.operation_done(operation, time.perf_counter() - started)
        if result is not None:
            self.metrics.requests_aborted(operation, aborted_count(result))

    # -- transitions ------------------------------------------------------------------

    async def pause(self, mode: str, clear_cache: bool = False) -> Outcome:
        operation = f"pause (mode {mode})"
        async with self._exclusive(operation) as deadline:
            if self.is_sleeping:
                raise self.conflict("cannot pause while sleeping: wake_up first")
            if self.pause_mode is not None:
                if self.pause_mode == mode:
                    return Outcome(False, {"status": "paused", "mode": mode})
                raise self.conflict(
                    f"already paused in mode '{self.pause_mode}': resume before pausing "
                    f"in mode '{mode}'"
                )

            async def undo() -> None:
                self.pause_mode = None
                await self._restore(RESUME, {})

            started = time.perf_counter()
            # Paused from the start, so readiness says so while a wait-mode pause drains.
            self.pause_mode = mode
            try:
                result = await self._bounded_call(
                    deadline,
                    operation,
                    "control",
                    PAUSE,
                    {"mode": mode, "clear_cache": clear_cache},
                    undo=undo,
                    hint=_WAIT_HINT if mode == "wait" else "",
                )
            except BaseException:
                self.pause_mode = None
                raise
            self._touch()
            self._record("pause", started, result)
            return Outcome(True, result)

    async def resume(self) -> Outcome:
        async with self._exclusive("resume") as deadline:
            if self.is_sleeping:
                raise self.conflict("the engine is sleeping: wake_up before resuming")
            if self.pause_mode is None:
                return Outcome(False, {"status": "resumed"})
            started = time.perf_counter()
            result = await self._bounded_call(deadline, "resume", "control", RESUME, {})
            self.pause_mode = None
            self._touch()
            self._record("resume", started)
            return Outcome(True, result)

    async def sleep(self, level: int, mode: str, tags: list[str] | None) -> Outcome:
        """Release ``tags`` (default: level 0 the KV cache, else everything)."""
        operation = f"sleep (mode {mode})"
        async with self._exclusive(operation) as deadline:
            wanted = frozenset(tags) if tags is not None else default_sleep_tags(level)
            if self.is_sleeping and wanted <= self.sleep_tags:
                return Outcome(False, {"status": "sleeping", "tags": sorted(self.sleep_tags)})
            # Requests frozen by a keep pause are not running: "wait" has nothing to wait
            # for, and the engine would wait on them forever. They stay frozen.
            engine_mode = "keep" if mode == "wait" and self.pause_mode == "keep" else mode
            added = sorted(wanted - self.sleep_tags)

            async def undo() -> None:
                await self._restore(WAKE_UP, {"tags": added})

            body: dict[str, Any] = {"level": level, "mode": engine_mode, "tags": sorted(wanted)}
            started = time.perf_counter()
            result = await self._bounded_call(
                deadline,
                operation,
                "control",
                SLEEP,
                body,
                undo=undo,
                hint=_WAIT_HINT if engine_mode == "wait" else "",
            )
            if self.sleep_level is None:
                self.sleep_level = level
            if isinstance(result.get("freed"), list):
                self.sleep_freed = {"freed": result["freed"], "sleep_note": result.get("message")}
            self.sleep_tags = self.sleep_tags | wanted
            self._touch()
            self._record("sleep", started, result)
            return Outcome(True, result)

    async def wake_up(self, tags: list[str] | None) -> Outcome:
        async with self._exclusive("wake_up") as deadline:
            if not self.is_sleeping:
                return Outcome(False, {"status": "awake"})
            body: dict[str, Any] = {} if tags is None else {"tags": list(tags)}
            started = time.perf_counter()
            result = await self._bounded_call(deadline, "wake_up", "control", WAKE_UP, body)
            remaining = self.sleep_tags - frozenset(tags if tags is not None else SLEEP_TAGS)
            if result.get("is_sleeping") is False or result.get("status") == "awake":
                remaining = frozenset()
            elif result.get("is_sleeping") is True and isinstance(result.get("tags"), list):
                # The engine says what it still holds released: the state follows it.
                remaining = frozenset(result["tags"])
            self.sleep_tags = remaining
            if not remaining:
                self.sleep_level = None
                self.sleep_freed = None
            self._touch()
            self._record("wake_up", started)
            return Outcome(True, result)

    def _update_admission(self, between_steps: bool) -> str:
        """How an update may apply in the current state: ``paused`` (the caller paused, or
        the engine pauses itself), ``between_steps`` (frozen here for it) or
        ``kv_released`` (asleep with the weights awake); else a 409 saying what to do."""
        if self.is_sleeping:
            if between_steps and "weights" not in self.sleep_tags:
                return "kv_released"
            raise self.conflict(
                "the engine is sleeping: wake_up, then pause_generation, before updating weights"
            )
        if self.pause_mode is not None or self.engine_pauses_for_updates:
            return "paused"
        if between_steps:
            return "between_steps"
        raise self.conflict(
            "pause generation before updating weights "
            "(POST /engine/pause_generation, /pause or /pause_generation)"
        )

    @contextlib.asynccontextmanager
    async def _frozen_for(self, deadline: float, update: str, applied: str) -> AsyncIterator[None]:
        """Around an update applied ``between_steps``: running requests frozen after the
        step in progress, and continued afterwards whatever the update did."""
        if applied != "between_steps":
            yield
            return

        async def undo() -> None:
            await self._restore(RESUME, {})

        await self._bounded_call(
            deadline, update, "control", PAUSE, {"mode": "keep", "clear_cache": False}, undo=undo
        )
        try:
            yield
        finally:
            await self._restore(RESUME, {})

    async def update_weights(
        self,
        update: str,
        body: dict[str, Any],
        version: str | None,
        *,
        param: str | None = None,
        between_steps: bool = False,
    ) -> Outcome:
        """Run a weight update (needs ``paused``, unless ``between_steps``: see the module);
        publish ``version`` once it succeeded."""
        async with self._exclusive(update) as deadline:
            applied = self._update_admission(between_steps)
            self.require_support("update", update)
            if update == "update_weights_from_tensor":
                body = tensor_update_body(body, trusted=self.trust_weight_payloads)

            async def undo() -> None:
                self.updating = self.update_target = None

            self.updating, self.update_target = update, version
            self._touch()
            started = time.perf_counter()
            try:
                async with self._frozen_for(deadline, update, applied):
                    result = await self._bounded_call(
                        deadline, update, "update", update, body, param=param, undo=undo
                    )
                    if version is not None:
                        await self._sync_engine_version(deadline, version, result, undo)
            except Exception as exc:
                if self.metrics is not None:
                    self.metrics.update_failed(update, failure_reason(exc))
                raise
            else:
                if self.metrics is not None:
                    self.metrics.update_done(update, time.perf_counter() - started)
            finally:
                self.updating = self.update_target = None
                self._touch()
            if version is not None:
                self._set_version(version)
            elif isinstance(result.get("weight_version"), str):
                self._set_version(result["weight_version"])
            self.last_update = {
                "method": update,
                "applied": applied,
                "weight_version": self.weight_version,
                "at": self.since,
            }
            return Outcome(True, result)

    async def _sync_engine_version(
        self,
        deadline: float,
        version: str,
        result: dict[str, Any],
        undo: Callable[[], Awaitable[None]],
    ) -> None:
        if result.get("weight_version") != version and self.supports(
            "update", "update_weight_version"
        ):
            await self._bounded_call(
                deadline,
                "update_weight_version",
                "update",
                "update_weight_version",
                {"new_version": version},
                undo=undo,
            )

    async def set_weight_version(self, version: str) -> Outcome:
        """Relabel the serving weights; any state but draining, no pause needed."""
        async with self._exclusive("update_weight_version") as deadline:
            if self.version_declared and self.weight_version == version:
                return Outcome(False, {"success": True, "new_version": version})
            result: dict[str, Any] = {"success": True, "new_version": version}
            if self.supports("update", "update_weight_version"):
                result = await self._bounded_call(
                    deadline,
                    "update_weight_version",
                    "update",
                    "update_weight_version",
                    {"new_version": version},
                )
            self._set_version(version)
            return Outcome(True, result)

    async def run_control(
        self, name: str, body: dict[str, Any], *, param: str | None = None
    ) -> dict[str, Any]:
        """An engine control with no state transition of its own (flush, profile, ...)."""
        if name in UNSERIALIZED_CONTROLS or name == ABORT_REQUEST:
            result = await self._bounded_call(
                self._deadline(), name, "control", name, body, param=param
            )
            if name == ABORT_REQUEST and self.metrics is not None:
                self.metrics.requests_aborted(name, aborted_count(result))
            return result
        async with self._exclusive(name) as deadline:
            return await self._bounded_call(deadline, name, "control", name, body, param=param)

    async def run_update(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """An engine update that is neither a weight update nor a version change."""
        if name == "init_weights_update_group":
            # The join gives up before the admin deadline, so the engine keeps no
            # half-joined group behind a 409.
            asked = body.get("timeout_s")
            bound = self.timeout_s * 0.8
            if isinstance(asked, int | float) and not isinstance(asked, bool) and asked > 0:
                bound = min(bound, float(asked))
            body = {**body, "timeout_s": bound}
        async with self._exclusive(name) as deadline:
            return await self._bounded_call(deadline, name, "update", name, body)
