"""The fleet's engine-side controls: RL admin calls fanned out to every Ray Serve replica.

Under ``--ray`` the admin plane (:mod:`penstock.rl`) drives :class:`FleetEngine` where it
drives an engine in one process, so every route and dialect (``/engine/*``, the SGLang and
vLLM routes) works unchanged. Each call reaches every live replica through
``DeploymentHandle.broadcast``; each replica answers with its name, so answers and errors
are per replica (:mod:`penstock.ray.wire`). The replica side is
:class:`~penstock.ray.replica_admin.ReplicaAdmin`, one per
:class:`~penstock.ray.replica.EngineReplica`.

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
* Rotation (:mod:`penstock.ray.rotation`): once a weight update has committed, requests
  go only to the replicas that hold the fleet's weights; :meth:`FleetEngine.catch_up`
  brings a replica Ray starts later to them (within a second or so of it appearing:
  a peer's weights through Ray's object store, else the fleet's last update replayed)
  so that it joins. The next fleet weight update includes a replica out of
  rotation (it joins if it then agrees with the replicas in rotation, whose agreement
  alone decides the transaction).
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
from typing import TYPE_CHECKING, Any

from penstock.engines.weights.sync import DEFAULT_GROUP_NAME
from penstock.errors import (
    FleetInconsistentError,
    InvalidRequestError,
    PenstockError,
    ReplicaLostError,
)
from penstock.ray.rotation import Rotation
from penstock.ray.wire import TRANSACTION_PAUSE_MODE, answer_error, failed_answer

if TYPE_CHECKING:
    from penstock.ray.adapters import FleetAdapters

logger = logging.getLogger(__name__)

INIT_GROUP = "init_weights_update_group"
DESTROY_GROUP = "destroy_weights_update_group"
WEIGHT_UPDATE_PREFIX = "update_weights_"
# Controls a failure of which is undone on the replicas that succeeded.
_UNDO = {"pause_generation": "resume_generation", "sleep": "wake_up"}
_SUMMED = frozenset({"flushed_entries"})
# The rollback broadcast outlives the admin deadline that cancelled the transaction.
_ROLLBACK_TIMEOUT_S = 120.0


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
        self._handle = handle
        self._adapters = adapters
        self._controls = set(description.get("controls", ()))
        self._updates = set(description.get("updates", ()))
        self.view: dict[str, dict[str, Any]] = {}
        self.view_at: float | None = None
        # Told every fresh view (the ingress's routing takes the replicas from it).
        self.on_view: Callable[[dict[str, dict[str, Any]]], None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Weight transactions and catch-ups of late replicas run one at a time.
        self._weights_lock = asyncio.Lock()
        self.rotation = Rotation(app_name)

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
            answers.append(failed_answer(f"replica #{index}", lost))
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
        first = self.rotation.reference(applied_answers)[0]
        self.rotation.commit(update, body, first, applied_answers)
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
        reference = self.rotation.reference(applied)
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

    async def catch_up(self) -> None:
        """Bring replicas out of rotation to the fleet's weights (once per committed update
        and replica): copied from a live peer in rotation, else by replaying the fleet's
        last update (:mod:`penstock.ray.rotation`); a replica that then reports the
        fleet's checksum and version joins the rotation."""
        if self._weights_lock.locked():
            return
        late = self.rotation.late([name for name, seen in self.view.items() if "state" in seen])
        if not late:
            return
        async with self._weights_lock:
            generation = self.rotation.generation
            members = sorted(self.rotation.members or ())
            donors = [name for name in members if "state" in self.view.get(name, {})]
            answers, source = None, ""
            if donors:
                source = f"the weights of replica {donors[0]}"
                answers = await self._copy_from(donors[0], members)
            if answers is None and self.rotation.replay is not None:
                update, body = self.rotation.replay
                source = update
                answers = await self.broadcast("sync", members, update, body)
            if answers is None:
                self.rotation.cannot_replay(late)
                return
            for name in self.rotation.replayed(source, late, generation, answers):
                logger.info("replica %s took %s and joins the rotation", name, source)
            self._note(answers)

    async def _copy_from(self, donor: str, members: list[str]) -> list[dict[str, Any]] | None:
        """Every replica's answer to taking ``donor``'s weights through Ray's object store
        (those in ``members`` keep theirs); None when ``donor`` could not share the fleet's
        weights."""
        shared = await self.broadcast("share", donor)
        offer = next((a for a in shared if a["replica"] == donor), None)
        if offer is None or not offer["ok"] or not offer.get("weights"):
            reason = offer["error"]["message"] if offer and not offer["ok"] else "no answer"
            logger.warning("replica %s could not share its weights: %s", donor, reason)
            return None
        if not self.rotation.holds(offer.get("checksum")):
            logger.warning("replica %s no longer holds the fleet's weights", donor)
            return None
        return await self.broadcast("adopt", members, offer["weights"])

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
        error = answer_error(failed)
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
        if self.on_view is not None:
            self.on_view(self.view)
        return self.view

    async def refresh_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
                await self.catch_up()
            except Exception:
                logger.debug("refreshing the fleet view failed", exc_info=True)
            await asyncio.sleep(interval_s)
