"""The fleet's engine-side controls: RL admin calls fanned out to every Ray Serve replica.

Under ``--ray`` the admin plane (:mod:`penstock.rl`) drives :class:`FleetEngine` where it
drives an engine in one process, so every route and dialect (``/engine/*``, the SGLang and
vLLM routes) works unchanged. Each call reaches every live replica through
``DeploymentHandle.broadcast``; each replica answers with its name, so answers and errors
are per replica. The replica side is :class:`ReplicaAdmin`, one per
:class:`~penstock.ray.replica.EngineReplica`, which judges engine answers exactly as the
single-process admin plane does (:meth:`AdminStateMachine.call_engine`).

* Controls (pause, resume, sleep, wake, flush cache, abort, ...) run on every replica.
  One answer merges them (``aborted`` lists joined, counts summed) and
  ``replicas`` holds each replica's own. If one replica fails a pause or sleep, the
  replicas that paused are resumed (woken) again, so the fleet stays in one state; the
  error is the failing replica's (same status and code as in one process), naming it,
  with ``error.replicas`` holding every replica's outcome.
* A weight update (``update_weights_from_disk|_tensor|_nixl``) is one transaction:

  1. ``begin``: each replica pauses (mode ``keep``: in-flight requests freeze, new ones
     wait, none is lost) unless the admin plane already paused or slept it, and keeps
     what it needs to undo the update (the engine's ``weights_snapshot()``: the sample
     engine keeps its weights object, the transformers engine a CPU copy of its tensors);
  2. ``apply``: each replica runs the update, sets the version, and reports the
     checksum of its whole model (``weights_checksum``) and its ``weight_version``;
  3. verify: every replica succeeded and all report one checksum and one version;
  4. ``end``: on success the snapshots are dropped, otherwise every replica restores its
     snapshot (``restore_weights_snapshot``); replicas the transaction paused resume.

  So a trainer may call the update without pausing first (the transaction pauses and
  resumes the fleet), or pause, update and resume as in one process. A failure answers
  with the failing replica's error and ``error.failed_replica``, ``error.replicas``
  (each replica's outcome, checksum and version after the rollback); the fleet then
  serves the previous weights and version. Replicas that disagree, or a rollback that
  fails, are a 500 ``fleet_inconsistent``. A deadline (``--admin-timeout-s``) that cuts
  the transaction short rolls it back the same way.

  An engine without ``weights_snapshot`` can be updated across a fleet of one replica
  only: with more, a failure could not be undone. ``update_weights_from_distributed``
  and its group routes are not offered across a fleet (each replica would need its own
  rank in the trainer's process group).
* :meth:`FleetEngine.refresh` asks every replica for its state, weight version and
  running requests; ``/health`` and ``/engine/capabilities`` show that view per replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from penstock.errors import (
    ConflictError,
    FleetInconsistentError,
    InternalServerError,
    InvalidRequestError,
    PenstockError,
    ReplicaLostError,
)
from penstock.rl.state import AdminStateMachine

if TYPE_CHECKING:
    from penstock.engines.host import EngineHost
    from penstock.ray.adapters import FleetAdapters

logger = logging.getLogger(__name__)

# Pausing in place freezes in-flight requests and holds new ones: nothing is lost.
TRANSACTION_PAUSE_MODE = "keep"
# The distributed broadcast needs a rank per replica in the trainer's group.
FLEET_UNOFFERED_UPDATES = frozenset(
    {
        "update_weights_from_distributed",
        "init_weights_update_group",
        "destroy_weights_update_group",
    }
)
WEIGHT_UPDATE_PREFIX = "update_weights_"
# Controls a failure of which is undone on the replicas that succeeded.
_UNDO = {"pause_generation": "resume_generation", "sleep": "wake_up"}
_SUMMED = frozenset({"flushed_entries"})
# The rollback broadcast outlives the admin deadline that cancelled the transaction.
_ROLLBACK_TIMEOUT_S = 120.0


def _ok(name: str, **fields: Any) -> dict[str, Any]:
    return {"replica": name, "ok": True, **fields}


def _failed(name: str, error: PenstockError) -> dict[str, Any]:
    return {
        "replica": name,
        "ok": False,
        "error": {
            "class": type(error).__name__,
            "status": error.status_code,
            "message": error.message,
            "param": error.param,
            "code": error.code,
        },
    }


@dataclass
class _Transaction:
    id: str
    snapshot: Any
    paused_here: bool


class ReplicaAdmin:
    """One replica's half of the fleet's admin calls (runs inside the Serve replica)."""

    def __init__(self, host: EngineHost, name: str) -> None:
        self.host = host
        self.name = name
        self._calls = AdminStateMachine(host.engine)
        self._txn: _Transaction | None = None
        # Steps of an update run one at a time: a rollback sent past the admin deadline
        # waits for an update still running here instead of racing it.
        self._steps = asyncio.Lock()
        self.paused: str | None = None
        self.sleeping = False

    async def run(self, operation: str, *args: Any) -> dict[str, Any]:
        """Run ``operation`` (``control``, ``update``, ``begin``, ``apply``, ``end``,
        ``status``); a :class:`PenstockError` becomes this replica's failed answer."""
        handler: Callable[..., Any] | None = {
            "control": self.control,
            "update": self.update,
            "begin": self.begin,
            "apply": self.apply,
            "end": self.end,
            "status": self.status,
        }.get(operation)
        if handler is None:
            return _failed(self.name, InvalidRequestError(f"unknown fleet operation {operation}"))
        try:
            if operation in ("begin", "apply", "end"):
                async with self._steps:
                    return await handler(*args)
            return await handler(*args)
        except PenstockError as exc:
            return _failed(self.name, exc)
        except Exception as exc:
            logger.exception("replica %s: fleet %s failed", self.name, operation)
            return _failed(self.name, InternalServerError(f"{operation} failed: {exc}"))

    async def control(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        result = await self._calls.call_engine("control", name, body)
        if name == "pause_generation":
            self.paused = str(body.get("mode", "abort"))
        elif name == "resume_generation":
            self.paused = None
        elif name == "sleep":
            self.sleeping = True
        elif name == "wake_up":
            self.sleeping = result.get("is_sleeping") is True
        return _ok(self.name, result=result)

    async def update(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return _ok(self.name, result=await self._calls.call_engine("update", name, body))

    async def begin(self, txn: str, pause_mode: str) -> dict[str, Any]:
        if self._txn is not None:
            # Left by an ingress that went away mid-transaction: never committed, undo it.
            logger.warning("replica %s: rolling back unfinished update %s", self.name, self._txn.id)
            await self.end(self._txn.id, True)
        paused_here = False
        if self.paused is None and not self.sleeping:
            await self._calls.call_engine("control", "pause_generation", {"mode": pause_mode})
            self.paused, paused_here = pause_mode, True
        snapshot = None
        take = getattr(self.host.engine, "weights_snapshot", None)
        try:
            if callable(take):
                snapshot = await take()
        except BaseException:
            if paused_here:
                await self._resume()
            raise
        self._txn = _Transaction(txn, snapshot, paused_here)
        return _ok(self.name, rollback=snapshot is not None, **await self._weights())

    async def apply(self, txn: str, update: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._txn is None or self._txn.id != txn:
            raise ConflictError(
                "this replica did not join the update (it started after the update began)",
                code="replica_not_in_update",
            )
        param = "model_path" if "model_path" in body else None
        result = await self._calls.call_engine("update", update, body, param=param)
        version = body.get("weight_version")
        reported = result.get("weight_version", result.get("version"))
        if (
            isinstance(version, str)
            and reported != version
            and self._calls.supports("update", "update_weight_version")
        ):
            await self._calls.call_engine(
                "update", "update_weight_version", {"new_version": version}
            )
        weights = await self._weights(result)
        return _ok(self.name, result=result, **weights)

    async def end(self, txn: str, rollback: bool) -> dict[str, Any]:
        current = self._txn
        if current is None or current.id != txn:
            return _ok(self.name, joined=False, **await self._weights())
        self._txn = None
        restored = False
        try:
            if rollback and current.snapshot is not None:
                await self.host.engine.restore_weights_snapshot(current.snapshot)
                restored = True
        finally:
            if current.paused_here:
                await self._resume()
        return _ok(self.name, restored=restored, **await self._weights())

    async def status(self) -> dict[str, Any]:
        weights = await self._weights(checksum=False)
        return _ok(
            self.name,
            state=self.host.state.value,
            healthy=self.host.health.healthy,
            paused=self.paused,
            sleeping=self.sleeping,
            updating=self._txn is not None,
            weight_version=weights.get("weight_version"),
        )

    async def _resume(self) -> None:
        await self._calls.call_engine("control", "resume_generation", {})
        self.paused = None

    async def _weights(
        self, result: dict[str, Any] | None = None, *, checksum: bool = True
    ) -> dict[str, Any]:
        """This replica's ``weight_version`` and whole-model ``checksum``, asked of the
        engine where it offers them, else as the update's answer says."""
        result = result or {}
        found: dict[str, Any] = {
            "weight_version": result.get("weight_version", result.get("version")),
            "checksum": result.get("checksum"),
        }
        if self._calls.supports("control", "get_weight_version"):
            answer = await self._calls.call_engine("control", "get_weight_version", {})
            found["weight_version"] = answer.get("weight_version")
        if checksum and self._calls.supports("control", "weights_checksum") and not self.sleeping:
            answer = await self._calls.call_engine("control", "weights_checksum", {})
            found["checksum"] = answer.get("checksum")
        return found


def _rebuild(answer: dict[str, Any]) -> PenstockError:
    from penstock.ray.fleet import rebuild_error

    return rebuild_error(answer["error"])


def merge_results(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine answer from every replica's: lists joined, counts summed, flags combined
    (``is_*``: all replicas; others: any), the rest as the first replica (by name) said."""
    results = [a["result"] for a in sorted(answers, key=lambda a: a["replica"])]
    merged: dict[str, Any] = dict(results[0]) if results else {"status": "ok"}
    for key in merged:
        values = [r.get(key) for r in results if key in r]
        if all(isinstance(v, list) for v in values):
            merged[key] = sorted({str(item) for v in values for item in v})
        elif all(isinstance(v, bool) for v in values):
            merged[key] = all(values) if key.startswith("is_") else any(values)
        elif key in _SUMMED and all(isinstance(v, int) for v in values):
            merged[key] = sum(values)
    merged["replicas"] = {a["replica"]: a["result"] for a in answers}
    return merged


class FleetEngine:
    """What the admin plane drives as the engine under ``--ray``: every replica at once."""

    # The admin plane lets a weight update run while serving: the transaction pauses.
    pauses_for_updates = True

    def __init__(self, handle: Any, description: dict[str, Any], adapters: FleetAdapters) -> None:
        self.class_name = description["engine_class"]
        self._handle = handle
        self._adapters = adapters
        self._controls = set(description.get("controls", ()))
        self._updates = set(description.get("updates", ())) - FLEET_UNOFFERED_UPDATES
        self.view: dict[str, dict[str, Any]] = {}
        self.view_at: float | None = None
        self._background: set[asyncio.Task[Any]] = set()

    def supported_controls(self) -> set[str]:
        return set(self._controls)

    def supported_updates(self) -> set[str]:
        return set(self._updates)

    async def broadcast(self, operation: str, *args: Any) -> list[dict[str, Any]]:
        """Every live replica's answer to ``operation``; a replica that died mid-call
        answers as a failed one named by its position."""
        response = self._handle.broadcast("admin", operation, *args)
        raw = await response.results_async(return_exceptions=True)
        answers = []
        for index, answer in enumerate(raw):
            if isinstance(answer, dict):
                answers.append(answer)
                continue
            logger.warning("replica %d failed fleet %s: %s", index, operation, answer)
            lost = ReplicaLostError(f"the replica failed during {operation}: {answer}")
            answers.append(_failed(f"replica #{index}", lost))
        return sorted(answers, key=lambda a: a["replica"])

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        answers = await self.broadcast("control", control, body)
        failed = [a for a in answers if not a["ok"]]
        if failed:
            undo = _UNDO.get(control)
            done = [a["replica"] for a in answers if a["ok"]]
            if undo is not None and done:
                tags = {"tags": body["tags"]} if control == "sleep" and "tags" in body else {}
                await self.broadcast("control", undo, tags)
            self._note(answers)
            raise self._failure(control, failed[0], answers)
        self._note(answers)
        return merge_results(answers)

    async def engine_update(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        if update.startswith(WEIGHT_UPDATE_PREFIX):
            return await self._transaction(update, body)
        if update in self._adapters.updates:
            return await self._adapters.update(update, body)
        answers = await self.broadcast("update", update, body)
        failed = [a for a in answers if not a["ok"]]
        if failed:
            raise self._failure(update, failed[0], answers)
        return merge_results(answers)

    async def _transaction(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        txn = uuid.uuid4().hex
        outcome: dict[str, dict[str, Any]] = {}
        failure: PenstockError | None = None
        try:
            begun = await self.broadcast("begin", txn, TRANSACTION_PAUSE_MODE)
            outcome = {a["replica"]: {"begin": a} for a in begun}
            failure = self._begin_failure(update, begun)
            if failure is None:
                applied = await self.broadcast("apply", txn, update, body)
                for answer in applied:
                    outcome.setdefault(answer["replica"], {})["apply"] = answer
                failure = self._apply_failure(update, applied)
        except BaseException:
            self._spawn_rollback(txn)
            raise
        ended = await self.broadcast("end", txn, failure is not None)
        detail = self._detail(outcome, ended)
        self._note(ended)
        if failure is not None:
            self._check_rolled_back(update, failure, ended, detail)
            failure.extra = {**failure.extra, "replicas": detail}
            raise failure
        for answer in ended:
            if not answer["ok"]:
                logger.warning(
                    "%s committed, but replica %s failed to resume: %s",
                    update,
                    answer["replica"],
                    answer["error"]["message"],
                )
        first = next(iter(outcome.values()))["apply"]
        result = dict(first["result"])
        result.update(weight_version=first["weight_version"], replicas=detail)
        result.setdefault("checksum", first["checksum"])
        return result

    def _begin_failure(self, update: str, begun: list[dict[str, Any]]) -> PenstockError | None:
        failed = [a for a in begun if not a["ok"]]
        if failed:
            return self._failure(update, failed[0], begun)
        if len(begun) > 1 and not all(a["rollback"] for a in begun):
            return InvalidRequestError(
                f"{update} across {len(begun)} replicas needs an engine that can undo an "
                f"update (weights_snapshot / restore_weights_snapshot); "
                f"{self.class_name} cannot",
                code="unsupported_by_engine",
            )
        return None

    def _apply_failure(self, update: str, applied: list[dict[str, Any]]) -> PenstockError | None:
        failed = [a for a in applied if not a["ok"]]
        if failed:
            return self._failure(update, failed[0], applied)
        checksums = {a["checksum"] for a in applied}
        versions = {a["weight_version"] for a in applied}
        if len(checksums) > 1 or len(versions) > 1:
            return FleetInconsistentError(
                f"{update}: the replicas disagree after the update (checksums "
                f"{sorted(map(str, checksums))}, versions {sorted(map(str, versions))}); "
                "rolled back",
                extra={"failed_replica": None},
            )
        return None

    def _check_rolled_back(
        self,
        update: str,
        failure: PenstockError,
        ended: list[dict[str, Any]],
        detail: dict[str, Any],
    ) -> None:
        broken = [a for a in ended if not a["ok"]]
        states = {(a.get("checksum"), a.get("weight_version")) for a in ended if a["ok"]}
        if broken or len(states) > 1:
            names = ", ".join(a["replica"] for a in broken) or "none failed"
            raise FleetInconsistentError(
                f"{update} failed ({failure.message}) and the rollback left the replicas "
                f"disagreeing ({names}): see error.replicas",
                extra={"replicas": detail, **failure.extra},
            )

    def _spawn_rollback(self, txn: str) -> None:
        """Roll back past a cancellation (the admin deadline): the replicas must not keep
        a half-applied update or stay paused."""

        async def rollback() -> None:
            try:
                async with asyncio.timeout(_ROLLBACK_TIMEOUT_S):
                    self._note(await self.broadcast("end", txn, True))
            except Exception:
                logger.exception("rolling back fleet update %s failed", txn)

        task = asyncio.get_running_loop().create_task(rollback())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    def _detail(
        outcome: dict[str, dict[str, Any]], ended: list[dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """Per replica: whether its update succeeded (else its error), and what it holds
        now (checksum, version, whether it was rolled back)."""
        detail: dict[str, dict[str, Any]] = {}
        for name, steps in outcome.items():
            failed = next((s for s in steps.values() if not s["ok"]), None)
            entry: dict[str, Any] = {"ok": failed is None}
            if failed is not None:
                entry["error"] = failed["error"]
            detail[name] = entry
        for answer in ended:
            entry = detail.setdefault(answer["replica"], {"ok": answer["ok"]})
            if answer["ok"]:
                entry.update(
                    rolled_back=answer.get("restored", False),
                    checksum=answer.get("checksum"),
                    weight_version=answer.get("weight_version"),
                )
            else:
                entry.update(ok=False, rollback_error=answer["error"])
        return detail

    def _failure(
        self, operation: str, failed: dict[str, Any], answers: list[dict[str, Any]]
    ) -> PenstockError:
        error = _rebuild(failed)
        error.message = f"{operation} failed on replica {failed['replica']}: {error.message}"
        error.extra = {
            **error.extra,
            "failed_replica": failed["replica"],
            "replicas": {
                a["replica"]: {"ok": a["ok"], **({} if a["ok"] else {"error": a["error"]})}
                for a in answers
            },
        }
        return error

    def _note(self, answers: list[dict[str, Any]]) -> None:
        """Keep what replicas said of their weights for the fleet view."""
        for answer in answers:
            if answer["ok"] and "weight_version" in answer:
                self.view.setdefault(answer["replica"], {})["weight_version"] = answer[
                    "weight_version"
                ]

    async def refresh(self) -> dict[str, dict[str, Any]]:
        """Ask every replica for its state, weight version and running requests."""
        answers = await self.broadcast("status")
        self.view = {
            a["replica"]: {k: v for k, v in a.items() if k not in ("replica", "ok")}
            for a in answers
        }
        self.view_at = time.time()
        return self.view

    async def refresh_forever(self, interval_s: float) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(interval_s)
