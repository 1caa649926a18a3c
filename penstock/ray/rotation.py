"""The rotation: which replicas hold the fleet's committed weights, and the replay that
brings a replica started later to them.

Before the first committed weight update every replica is routed to. From then on only
the replicas that reported the committed checksum and version are
(:func:`penstock.ray.routing.set_rotation`). A replica Ray starts later (a replacement,
autoscaling) begins on the checkpoint's weights, so it stays out until it holds the
fleet's: a disk update is replayed on it (:meth:`FleetEngine.catch_up
<penstock.ray.fleet_admin.FleetEngine.catch_up>` drives the broadcast) and it joins once it
reports the fleet's checksum and version. Other updates (tensors, NIXL, broadcast) are not
kept, so such a replica stays out, ``/health`` says why, and the next fleet weight update
includes it. :class:`Rotation` holds this state and judges the replicas' answers; it
sends nothing itself.
"""

from __future__ import annotations

from typing import Any

from penstock.ray.routing import set_rotation

# Updates whose request alone reproduces the weights on a replica started later.
REPLAYABLE_UPDATES = frozenset({"update_weights_from_disk"})


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
        # Only a disk update can be run again later as it ran now.
        self.replay = (update, dict(body)) if update in REPLAYABLE_UPDATES else None
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

    def state(self, name: str) -> dict[str, Any]:
        """Whether ``name`` is routed to and, when not, why (for ``/health``)."""
        if self.members is None or name in self.members:
            return {"in_rotation": True}
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
        """Say why ``late`` stay out when the fleet's last update cannot be replayed."""
        weights = self.fleet_weights or {}
        for name in late:
            self.out_of_rotation[name] = (
                f"started after the fleet's last weight update ({weights.get('update')}), "
                "which cannot be replayed; the next fleet weight update includes it"
            )
            self._synced[name] = self.generation

    def replayed(
        self, update: str, late: list[str], generation: int, answers: list[dict[str, Any]]
    ) -> list[str]:
        """Judge the ``sync`` answers of replaying ``update`` (commit ``generation``): the
        ``late`` replicas now on the fleet's weights join the rotation. Returns those."""
        joined = set()
        for answer in answers:
            name = answer["replica"]
            if name not in late or answer.get("current") is True:
                continue
            self._synced[name] = generation
            if self._holds_fleet_weights(answer):
                joined.add(name)
                self.out_of_rotation.pop(name, None)
            elif answer["ok"]:
                self.out_of_rotation[name] = f"replayed {update} but " + self._mismatch(answer)
            else:
                self.out_of_rotation[name] = (
                    f"replaying {update} failed: {answer['error']['message']}"
                )
        if joined and self.members is not None:
            self._publish(self.members | joined)
        return sorted(joined)

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
