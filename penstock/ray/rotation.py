"""The rotation: which replicas hold the fleet's committed weights, and how a replica
started later is brought to them.

Before the first committed weight update every replica is routed to. From then on only
the replicas that reported the committed checksum and version are
(:func:`penstock.ray.routing.set_rotation`). A replica Ray starts later (a replacement
after a crash, autoscaling) begins on the checkpoint's weights, so it stays out until it
holds the fleet's (:meth:`FleetEngine.catch_up
<penstock.ray.fleet_admin.FleetEngine.catch_up>` drives it, within a second or so of the
replica appearing):

1. from a peer: a replica in rotation puts its weights in Ray's object store and the late
   one takes them, whatever update made them (disk, tensors, NIXL, a broadcast);
2. with no live peer in rotation (a fleet of one), by replaying the fleet's last update,
   which the ingress keeps when its request alone reproduces the weights: a disk update,
   or a tensor push (the trainer's payload, held until the next update);
3. otherwise it stays out, ``/health`` says why, and the next fleet weight update
   includes it.

Either way it joins only once it reports the fleet's checksum and version, and each late
replica is tried once per committed update. :class:`Rotation` holds this state and judges
the replicas' answers; it sends nothing itself.
"""

from __future__ import annotations

from typing import Any

from penstock.ray.routing import set_rotation

# Updates whose request alone reproduces the weights on a replica started later (a tensor
# push whose payload only pointed at the trainer's memory fails the checksum instead).
REPLAYABLE_UPDATES = frozenset({"update_weights_from_disk", "update_weights_from_tensor"})


class Rotation:
    """The replicas routed to, the fleet's committed weights, and how to replay them."""

    def __init__(self, app_name: str) -> None:
        self._app_name = app_name
        # All None until the first committed weight update: every replica is routed to.
        self.members: frozenset[str] | None = None
        self.fleet_weights: dict[str, Any] | None = None
        self.replay: tuple[str, dict[str, Any]] | None = None
        # Counts commits, so a late replica is tried once per committed update.
        self.generation = 0
        self.out_of_rotation: dict[str, str] = {}
        # How each replica that joined since the last commit got the fleet's weights.
        self.caught_up_from: dict[str, str] = {}
        self._synced: dict[str, int] = {}

    def reference(self, answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The answers that must agree: those of replicas in rotation (a late replica not
        yet on the fleet's weights may end elsewhere, and then stays out of rotation)."""
        taking = [a for a in answers if not a.get("skipped")]
        if self.members is None:
            return taking
        return [a for a in taking if a["replica"] in self.members] or taking

    def commit(
        self,
        update: str,
        body: dict[str, Any],
        reference: dict[str, Any],
        applied: list[dict[str, Any]],
    ) -> None:
        """Route to the replicas holding the committed weights from now on."""
        self.generation += 1
        self.fleet_weights = {
            "weight_version": reference["weight_version"],
            "checksum": reference["checksum"],
            "update": update,
        }
        # Kept for a fleet left with no peer to copy from (see REPLAYABLE_UPDATES).
        self.replay = (update, dict(body)) if update in REPLAYABLE_UPDATES else None
        members = set()
        self.out_of_rotation = {}
        self.caught_up_from = {}
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

    def state(self, name: str) -> dict[str, Any]:
        """Whether ``name`` is routed to and, when not, why; for a replica that joined
        late, what it took the fleet's weights from (for ``/health``)."""
        if self.members is None or name in self.members:
            source = self.caught_up_from.get(name)
            return {"in_rotation": True, **({"caught_up_from": source} if source else {})}
        reason = self.out_of_rotation.get(
            name, "started after the fleet's last weight update: not yet on its weights"
        )
        return {"in_rotation": False, "out_of_rotation": reason}

    def late(self, replicas: list[str]) -> list[str]:
        """Those of ``replicas`` out of rotation and not yet tried since the last commit."""
        if self.members is None:
            return []
        return [
            name
            for name in replicas
            if name not in self.members and self._synced.get(name) != self.generation
        ]

    def cannot_replay(self, late: list[str]) -> None:
        """Say why ``late`` stay out when no peer in rotation could hand them the fleet's
        weights and the fleet's last update cannot be replayed."""
        weights = self.fleet_weights or {}
        for name in late:
            self.out_of_rotation[name] = (
                f"started after the fleet's last weight update ({weights.get('update')}); "
                "no replica in rotation could hand it the weights and that update cannot "
                "be replayed: the next fleet weight update includes it"
            )
            self._synced[name] = self.generation

    def replayed(
        self, source: str, late: list[str], generation: int, answers: list[dict[str, Any]]
    ) -> list[str]:
        """Judge the ``late`` replicas' answers (``sync`` or ``adopt``) to being brought to
        commit ``generation``'s weights from ``source`` (the update replayed, or the peer
        copied): those now on the fleet's weights join the rotation. Returns those."""
        joined = set()
        for answer in answers:
            name = answer["replica"]
            if name not in late or answer.get("current") is True:
                continue
            self._synced[name] = generation
            if self._holds_fleet_weights(answer):
                joined.add(name)
                self.out_of_rotation.pop(name, None)
                self.caught_up_from[name] = source
            elif answer["ok"]:
                self.out_of_rotation[name] = f"took {source} but " + self._mismatch(answer)
            else:
                self.out_of_rotation[name] = f"taking {source} failed: {answer['error']['message']}"
        if joined and self.members is not None:
            self._publish(self.members | joined)
        return sorted(joined)

    def holds(self, checksum: Any) -> bool:
        """Whether ``checksum`` is the fleet's committed one."""
        return self.fleet_weights is not None and checksum == self.fleet_weights["checksum"]

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
        self.members = members
        set_rotation(self._app_name, members)
