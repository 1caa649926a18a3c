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
  only: with more, a failure could not be undone.
* The collective broadcast (``init_weights_update_group``,
  ``update_weights_from_distributed``, ``destroy_weights_update_group``; SGLang's and
  vLLM's routes alike), as verl and OpenRLHF drive several vLLM engines: the trainer is
  rank 0 of a group of ``rank_offset + N`` ranks, N the fleet's live replicas
  (``/engine/capabilities`` ``fleet.size``; a wrong ``world_size`` is a 400 that names
  the right one). The ingress gives replica ``i`` (in name order) rank
  ``rank_offset + i`` and every replica joins at once; the init answer lists the
  ``ranks``. If one cannot join, all leave the group. An update broadcast then runs
  inside the transaction above on every replica at once (each receives the trainer's
  one broadcast), verified and rolled back as any other update. A replica that is not
  a rank of the group (it started later) skips the update and stays out of rotation
  until the trainer re-creates the group with it.
* Rotation: once a weight update has committed, requests go only to the replicas that
  hold the fleet's weights (:func:`penstock.ray.routing.set_rotation`). A replica Ray
  starts later (a replacement, autoscaling) begins on the checkpoint's weights, so it is
  out of rotation until the ingress brings it to the fleet's: a disk update is replayed
  on it (:meth:`FleetEngine.catch_up`, within a second or so of it appearing) and it
  joins once it reports the fleet's checksum and version. Other updates (tensors,
  NIXL, broadcast) are not kept, so such a replica stays out, ``/health`` says why, and
  the next fleet weight update includes it (it joins if it then agrees with the replicas
  in rotation, whose agreement alone decides the transaction).
* :meth:`FleetEngine.refresh` asks every replica for its state, weight version and
  running requests; ``/health`` and ``/engine/capabilities`` show that view per replica
  (``in_rotation``, ``out_of_rotation``: why not; ``fleet_weights``: the committed
  checksum and version).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from penstock.engines.weight_sync import DEFAULT_GROUP_NAME
from penstock.errors import (
    ConflictError,
    FleetInconsistentError,
    InternalServerError,
    InvalidRequestError,
    PenstockError,
    ReplicaLostError,
)
from penstock.ray.routing import set_rotation
from penstock.rl.state import AdminStateMachine

if TYPE_CHECKING:
    from penstock.engines.host import EngineHost
    from penstock.ray.adapters import FleetAdapters

logger = logging.getLogger(__name__)

# Pausing in place freezes in-flight requests and holds new ones: nothing is lost.
TRANSACTION_PAUSE_MODE = "keep"
DISTRIBUTED_UPDATE = "update_weights_from_distributed"
INIT_GROUP = "init_weights_update_group"
DESTROY_GROUP = "destroy_weights_update_group"
WEIGHT_UPDATE_PREFIX = "update_weights_"
# Updates whose request alone reproduces the weights on a replica started later.
REPLAYABLE_UPDATES = frozenset({"update_weights_from_disk"})
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
        # The trainer's weights update groups this replica joined: name -> its rank.
        self.groups: dict[str, int] = {}

    async def run(self, operation: str, *args: Any) -> dict[str, Any]:
        """Run ``operation`` (``control``, ``update``, ``begin``, ``apply``, ``end``,
        ``status``); a :class:`PenstockError` becomes this replica's failed answer."""
        handler: Callable[..., Any] | None = {
            "control": self.control,
            "update": self.update,
            "begin": self.begin,
            "apply": self.apply,
            "end": self.end,
            "sync": self.sync,
            "join": self.join,
            "leave": self.leave,
            "status": self.status,
        }.get(operation)
        if handler is None:
            return _failed(self.name, InvalidRequestError(f"unknown fleet operation {operation}"))
        try:
            if operation in ("begin", "apply", "end", "sync"):
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

    async def join(self, body: dict[str, Any], ranks: dict[str, int]) -> dict[str, Any]:
        """``init_weights_update_group`` with this replica's own rank of ``ranks``."""
        rank = ranks.get(self.name)
        if rank is None:
            raise ConflictError(
                "this replica started after the fleet's ranks were assigned; "
                "call init_weights_update_group again",
                code="replica_not_in_group",
            )
        name = str(body.get("group_name") or DEFAULT_GROUP_NAME)
        result = await self._calls.call_engine(
            "update", "init_weights_update_group", {**body, "rank_offset": rank}
        )
        self.groups[name] = rank
        return _ok(self.name, result=result, rank=rank)

    async def leave(self, body: dict[str, Any]) -> dict[str, Any]:
        """``destroy_weights_update_group``; a replica that never joined the group has
        nothing to destroy."""
        name = str(body.get("group_name") or DEFAULT_GROUP_NAME)
        if name not in self.groups:
            return _ok(self.name, result={"status": "ok", "message": "not in the group"})
        result = await self._calls.call_engine("update", "destroy_weights_update_group", body)
        self.groups.pop(name, None)
        return _ok(self.name, result=result)

    def _in_group(self, body: dict[str, Any]) -> bool:
        name = body.get("group_name")
        return name in self.groups if name else len(self.groups) == 1

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
        if update == DISTRIBUTED_UPDATE and not self._in_group(body):
            # Not a rank of the trainer's group (it started after the group was made): it
            # keeps its weights and stays out of rotation.
            return _ok(self.name, skipped=True, **await self._weights())
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

    async def sync(
        self, members: list[str], update: str | None, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Bring this replica to the fleet's weights by replaying the fleet's last update
        (``update`` with ``body``), unless it is one of the ``members`` that hold them."""
        if self.name in members:
            return _ok(self.name, current=True)
        if update is None:
            raise ConflictError(
                "the fleet's last weight update cannot be replayed here",
                code="weights_not_replayable",
            )
        txn = f"sync-{uuid.uuid4().hex}"
        await self.begin(txn, TRANSACTION_PAUSE_MODE)
        try:
            applied = await self.apply(txn, update, body)
        except BaseException:
            await self.end(txn, True)
            raise
        await self.end(txn, False)
        return {**applied, "current": False}

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

    def __init__(
        self,
        handle: Any,
        description: dict[str, Any],
        adapters: FleetAdapters,
        app_name: str = "",
    ) -> None:
        self.class_name = description["engine_class"]
        self._app_name = app_name
        self._handle = handle
        self._adapters = adapters
        self._controls = set(description.get("controls", ()))
        self._updates = set(description.get("updates", ()))
        self.view: dict[str, dict[str, Any]] = {}
        self.view_at: float | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Weight transactions and catch-ups of late replicas run one at a time.
        self._weights_lock = asyncio.Lock()
        # Set by the first committed weight update: the replicas holding the fleet's
        # weights (the only ones routed to), those weights, and how to replay them.
        self.rotation: frozenset[str] | None = None
        self.fleet_weights: dict[str, Any] | None = None
        self._replay: tuple[str, dict[str, Any]] | None = None
        self._generation = 0
        self.out_of_rotation: dict[str, str] = {}
        self._synced: dict[str, int] = {}

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
        if update == INIT_GROUP:
            return await self._init_group(body)
        if update == DESTROY_GROUP:
            return await self._merged("leave", update, body)
        if update.startswith(WEIGHT_UPDATE_PREFIX):
            return await self._transaction(update, body)
        if update in self._adapters.updates:
            return await self._adapters.update(update, body)
        answers = await self.broadcast("update", update, body)
        failed = [a for a in answers if not a["ok"]]
        if failed:
            raise self._failure(update, failed[0], answers)
        return merge_results(answers)

    async def _merged(self, operation: str, update: str, *args: Any) -> dict[str, Any]:
        answers = await self.broadcast(operation, *args)
        failed = [a for a in answers if not a["ok"]]
        if failed:
            raise self._failure(update, failed[0], answers)
        return merge_results(answers)

    async def _init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        """Every live replica joins the trainer's group, replica ``i`` (by name) as rank
        ``rank_offset + i``: the trainer makes a group of ``rank_offset + N`` ranks."""
        offset = body.get("rank_offset", 1)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 1:
            raise InvalidRequestError(
                "'rank_offset' must be an integer of at least 1 (the trainer is rank 0)",
                param="rank_offset",
                code="invalid_value",
            )
        live = sorted(a["replica"] for a in await self.broadcast("status") if a["ok"])
        world_size = body.get("world_size")
        if world_size != offset + len(live):
            raise InvalidRequestError(
                f"'world_size' must be rank_offset + one rank per replica: this fleet has "
                f"{len(live)} replicas, so {offset + len(live)} with rank_offset {offset}; "
                f"got {world_size!r}",
                param="world_size",
                code="invalid_value",
            )
        ranks = {name: offset + index for index, name in enumerate(live)}
        answers = await self.broadcast("join", body, ranks)
        failed = [a for a in answers if not a["ok"]]
        if failed:
            # A group some replicas never joined cannot broadcast: leave it everywhere.
            group = {"group_name": body.get("group_name") or DEFAULT_GROUP_NAME}
            await self.broadcast("leave", group)
            raise self._failure(INIT_GROUP, failed[0], answers)
        merged = merge_results(answers)
        merged["ranks"] = ranks
        merged["message"] = (
            f"{len(ranks)} replicas joined as ranks {offset}..{offset + len(ranks) - 1} "
            f"of {world_size}"
        )
        return merged

    async def _transaction(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._weights_lock:
            return await self._run_transaction(update, body)

    async def _run_transaction(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
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
        applied_answers = [steps["apply"] for steps in outcome.values()]
        first = self._reference(applied_answers)[0]
        self._commit(update, body, first, applied_answers)
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
        if all(a.get("skipped") for a in applied):
            return InvalidRequestError(
                f"{update}: no replica is in the weights update group; "
                "call init_weights_update_group first",
                param="group_name",
                code="invalid_value",
            )
        reference = self._reference(applied)
        checksums = {a["checksum"] for a in reference}
        versions = {a["weight_version"] for a in reference}
        if len(checksums) > 1 or len(versions) > 1:
            return FleetInconsistentError(
                f"{update}: the replicas disagree after the update (checksums "
                f"{sorted(map(str, checksums))}, versions {sorted(map(str, versions))}); "
                "rolled back",
                extra={"failed_replica": None},
            )
        return None

    def _reference(self, answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The answers that must agree: those of replicas in rotation (a late replica not
        yet on the fleet's weights may end elsewhere, and then stays out of rotation)."""
        taking = [a for a in answers if not a.get("skipped")]
        if self.rotation is None:
            return taking
        return [a for a in taking if a["replica"] in self.rotation] or taking

    def _commit(
        self,
        update: str,
        body: dict[str, Any],
        reference: dict[str, Any],
        applied: list[dict[str, Any]],
    ) -> None:
        """Route to the replicas holding the committed weights from now on."""
        self._generation += 1
        self.fleet_weights = {
            "weight_version": reference["weight_version"],
            "checksum": reference["checksum"],
            "update": update,
        }
        # Only a disk update can be run again later as it ran now.
        self._replay = (update, dict(body)) if update in REPLAYABLE_UPDATES else None
        members = set()
        self.out_of_rotation = {}
        for answer in applied:
            if self._holds_fleet_weights(answer) and not answer.get("skipped"):
                members.add(answer["replica"])
            elif answer.get("skipped"):
                self.out_of_rotation[answer["replica"]] = (
                    "not a rank of the trainer's weights update group, so it missed "
                    f"{update}; init_weights_update_group again to include it"
                )
            else:
                self.out_of_rotation[answer["replica"]] = self._mismatch(answer)
        self._publish(frozenset(members))

    def _holds_fleet_weights(self, answer: dict[str, Any]) -> bool:
        weights = self.fleet_weights or {}
        return bool(
            answer["ok"]
            and answer.get("checksum") == weights.get("checksum")
            and answer.get("weight_version") == weights.get("weight_version")
        )

    def _mismatch(self, answer: dict[str, Any]) -> str:
        weights = self.fleet_weights or {}
        return (
            f"holds checksum {answer.get('checksum')} version {answer.get('weight_version')}, "
            f"not the fleet's {weights.get('checksum')} {weights.get('weight_version')}"
        )

    def _publish(self, members: frozenset[str]) -> None:
        self.rotation = members
        set_rotation(self._app_name, members)

    def rotation_state(self, name: str) -> dict[str, Any]:
        """Whether ``name`` is routed to and, when not, why (for ``/health``)."""
        if self.rotation is None or name in self.rotation:
            return {"in_rotation": True}
        reason = self.out_of_rotation.get(
            name, "started after the fleet's last weight update: not yet on its weights"
        )
        return {"in_rotation": False, "out_of_rotation": reason}

    async def catch_up(self) -> None:
        """Bring replicas out of rotation to the fleet's weights by replaying the fleet's
        last update on them (once per update and replica); a replica that then reports the
        fleet's checksum and version joins the rotation."""
        if self.rotation is None or self._weights_lock.locked():
            return
        late = [
            name
            for name in self.view
            if name not in self.rotation and self._synced.get(name) != self._generation
        ]
        if not late:
            return
        if self._replay is None:
            weights = self.fleet_weights or {}
            for name in late:
                self.out_of_rotation[name] = (
                    f"started after the fleet's last weight update ({weights.get('update')}), "
                    "which cannot be replayed; the next fleet weight update includes it"
                )
                self._synced[name] = self._generation
            return
        async with self._weights_lock:
            generation = self._generation
            update, body = self._replay
            answers = await self.broadcast("sync", sorted(self.rotation), update, body)
            joined = set()
            for answer in answers:
                name = answer["replica"]
                if name not in late or answer.get("current") is True:
                    continue
                self._synced[name] = generation
                if self._holds_fleet_weights(answer):
                    joined.add(name)
                    self.out_of_rotation.pop(name, None)
                    logger.info("replica %s replayed %s and joins the rotation", name, update)
                elif answer["ok"]:
                    self.out_of_rotation[name] = f"replayed {update} but " + self._mismatch(answer)
                else:
                    self.out_of_rotation[name] = (
                        f"replaying {update} failed: {answer['error']['message']}"
                    )
            if joined:
                self._publish(self.rotation | joined)
            self._note(answers)

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
            try:
                await self.refresh()
                await self.catch_up()
            except Exception:
                logger.debug("refreshing the fleet view failed", exc_info=True)
            await asyncio.sleep(interval_s)
