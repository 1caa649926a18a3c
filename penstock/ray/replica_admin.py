"""One replica's half of the fleet's admin calls, inside the Serve replica.

:class:`ReplicaAdmin` runs what :class:`~penstock.ray.fleet_admin.FleetEngine` broadcasts
to every replica (``control``, ``update``, the weight update transaction's ``begin``,
``apply`` and ``end``, ``sync`` (replaying the fleet's last update), ``share`` and
``adopt`` (a peer's weights through Ray's object store), ``join`` and ``leave`` of the
trainer's weights update group, ``status``) and judges the engine's answers exactly
as the single-process admin plane does (:meth:`AdminStateMachine.call_engine`). Each
answer carries this replica's name; an error is this replica's failed answer
(:mod:`penstock.ray.wire`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from penstock.engines.weights.sync import DEFAULT_GROUP_NAME
from penstock.errors import ConflictError, InternalServerError, InvalidRequestError, PenstockError
from penstock.ray import require_ray
from penstock.ray.wire import TRANSACTION_PAUSE_MODE, failed_answer, ok_answer
from penstock.rl.state import AdminStateMachine

if TYPE_CHECKING:
    from penstock.engines.host import EngineHost

logger = logging.getLogger(__name__)

DISTRIBUTED_UPDATE = "update_weights_from_distributed"


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
        # The whole-model checksum as last computed (every weight step computes it), so
        # the fleet view shows it without hashing the model once a second.
        self.checksum: str | None = None

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
            "share": self.share,
            "adopt": self.adopt,
            "join": self.join,
            "leave": self.leave,
            "status": self.status,
        }.get(operation)
        if handler is None:
            unknown = InvalidRequestError(f"unknown fleet operation {operation}")
            return failed_answer(self.name, unknown)
        try:
            if operation in ("begin", "apply", "end", "sync", "adopt"):
                async with self._steps:
                    return await handler(*args)
            return await handler(*args)
        except PenstockError as exc:
            return failed_answer(self.name, exc)
        except Exception as exc:
            logger.exception("replica %s: fleet %s failed", self.name, operation)
            return failed_answer(self.name, InternalServerError(f"{operation} failed: {exc}"))

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
        return ok_answer(self.name, result=result)

    async def update(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return ok_answer(self.name, result=await self._calls.call_engine("update", name, body))

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
        return ok_answer(self.name, result=result, rank=rank)

    async def leave(self, body: dict[str, Any]) -> dict[str, Any]:
        """``destroy_weights_update_group``; a replica that never joined the group has
        nothing to destroy."""
        name = str(body.get("group_name") or DEFAULT_GROUP_NAME)
        if name not in self.groups:
            return ok_answer(self.name, result={"status": "ok", "message": "not in the group"})
        result = await self._calls.call_engine("update", "destroy_weights_update_group", body)
        self.groups.pop(name, None)
        return ok_answer(self.name, result=result)

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
        return ok_answer(self.name, rollback=snapshot is not None, **await self._weights())

    async def apply(self, txn: str, update: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._txn is None or self._txn.id != txn:
            raise ConflictError(
                "this replica did not join the update (it started after the update began)",
                code="replica_not_in_update",
            )
        if update == DISTRIBUTED_UPDATE and not self._in_group(body):
            # Not a rank of the trainer's group (it started after the group was made): it
            # keeps its weights and stays out of rotation.
            return ok_answer(self.name, skipped=True, **await self._weights())
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
        return ok_answer(self.name, result=result, **weights)

    async def end(self, txn: str, rollback: bool) -> dict[str, Any]:
        current = self._txn
        if current is None or current.id != txn:
            return ok_answer(self.name, joined=False, **await self._weights())
        self._txn = None
        restored = False
        try:
            if rollback and current.snapshot is not None:
                await self.host.engine.restore_weights_snapshot(current.snapshot)
                restored = True
        finally:
            if current.paused_here:
                await self._resume()
        return ok_answer(self.name, restored=restored, **await self._weights())

    async def sync(
        self, members: list[str], update: str | None, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Bring this replica to the fleet's weights by replaying the fleet's last update
        (``update`` with ``body``), unless it is one of the ``members`` that hold them."""
        if self.name in members:
            return ok_answer(self.name, current=True)
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

    async def share(self, donor: str) -> dict[str, Any]:
        """On the ``donor`` only: this replica's weights (the engine's
        ``weights_snapshot()``, as a rollback keeps them) put in Ray's object store, for
        replicas that start later to :meth:`adopt`; ``weights`` holds the one reference.
        The others answer with nothing to share."""
        if self.name != donor:
            return ok_answer(self.name, weights=None)
        take = getattr(self.host.engine, "weights_snapshot", None)
        if not callable(take):
            raise ConflictError(
                f"{type(self.host.engine).__name__} cannot hand its weights to another replica",
                code="weights_not_shareable",
            )
        ray, _ = require_ray()
        snapshot = await take()
        reference = await asyncio.to_thread(ray.put, snapshot)
        # In a list: Ray passes a reference nested in a value on as a reference.
        return ok_answer(self.name, weights=[reference], **await self._weights())

    async def adopt(self, members: list[str], weights: list[Any]) -> dict[str, Any]:
        """Take a peer's weights (what its :meth:`share` put in the object store), paused
        in ``keep`` mode meanwhile, unless this is one of the ``members`` that hold the
        fleet's weights. The answer's checksum decides whether this replica joins."""
        if self.name in members:
            return ok_answer(self.name, current=True)
        snapshot = await weights[0]
        paused_here = self.paused is None and not self.sleeping
        if paused_here:
            await self._calls.call_engine(
                "control", "pause_generation", {"mode": TRANSACTION_PAUSE_MODE}
            )
            self.paused = TRANSACTION_PAUSE_MODE
        try:
            await self.host.engine.restore_weights_snapshot(snapshot)
        finally:
            if paused_here:
                await self._resume()
        return ok_answer(self.name, current=False, **await self._weights())

    async def status(self) -> dict[str, Any]:
        weights = await self._weights(checksum=self.checksum is None)
        return ok_answer(
            self.name,
            state=self.host.state.value,
            healthy=self.host.health.healthy,
            paused=self.paused,
            sleeping=self.sleeping,
            updating=self._txn is not None,
            weight_version=weights.get("weight_version"),
            checksum=self.checksum,
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
        if found["checksum"] is not None:
            self.checksum = str(found["checksum"])
        return found
