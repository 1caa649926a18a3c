"""``weights_checker``, the same for every admin dialect: SGLang's actions over the
engine's ``weights_checksum`` and ``reset_weights`` controls.

* ``snapshot`` (also ``checksum``, which answers with the digests too) keeps the per-tensor
  digests of the weights serving now as the baseline;
* ``reset_tensors`` overwrites every weight tensor with random values (the engine's
  ``reset_weights``), so a following ``compare`` shows whether a push rewrote them all;
* ``compare`` checks the weights serving now against the body's ``baseline`` (``{name:
  digest}``, or a checksum string for the whole model) or else the kept one: a match is
  ``{"success": true, "match": true}``, a difference a 400 (``weights_mismatch``) naming
  the tensors that differ;
* ``reset`` forgets the baseline.

The digests are SHA-256 of each tensor's bytes, so a compare is exact; the algorithm is
in :mod:`penstock.engines.weights.sync`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from penstock.engines.controls import RESET_WEIGHTS, WEIGHTS_CHECKSUM
from penstock.errors import ConflictError, InvalidRequestError

if TYPE_CHECKING:
    from penstock.rl.state import AdminStateMachine

CHECKER_ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum", "reset")
MAX_NAMED_MISMATCHES = 20


class WeightsChecker:
    def __init__(self, state: AdminStateMachine) -> None:
        self.state = state
        self.baseline: dict[str, str] | None = None
        self.baseline_checksum: str | None = None

    def _refuse_if_asleep(self, doing: str) -> None:
        if self.state.is_sleeping and "weights" in self.state.sleep_tags:
            raise self.state.conflict(f"the weights are asleep: wake_up before {doing} them")

    async def _checksum(self) -> dict[str, Any]:
        self._refuse_if_asleep("checking")
        return await self.state.run_control(WEIGHTS_CHECKSUM, {})

    async def run(self, body: dict[str, Any]) -> dict[str, Any]:
        action = body.get("action", "checksum")
        if action not in CHECKER_ACTIONS:
            raise InvalidRequestError(
                f"Unsupported 'action' {action!r}: one of {', '.join(CHECKER_ACTIONS)}",
                param="action",
                code="invalid_value",
            )
        if action == "reset":
            self.baseline = self.baseline_checksum = None
            return {"status": "reset", "success": True}
        if action == "reset_tensors":
            self._refuse_if_asleep("resetting")
            self.state.require_support("control", RESET_WEIGHTS)
            result = await self.state.run_control(RESET_WEIGHTS, {})
            return {"success": True, "checksum": result.get("checksum")}
        result = await self._checksum()
        digests: dict[str, str] = result.get("tensors", {})
        checksum = result.get("checksum")
        if action == "compare":
            return self._compare(body.get("baseline"), digests, checksum)
        self.baseline, self.baseline_checksum = dict(digests), checksum
        kept: dict[str, Any] = {"success": True, "checksum": checksum}
        if action == "checksum":
            kept |= {"checksums": digests, "weight_version": self.state.weight_version}
        return kept

    def _compare(self, baseline: Any, digests: dict[str, str], checksum: Any) -> dict[str, Any]:
        if baseline is None:
            if self.baseline is None:
                raise ConflictError(
                    "no baseline to compare with: send 'baseline' or call action snapshot first",
                    code="no_baseline",
                )
            baseline = self.baseline
        if isinstance(baseline, str):
            mismatches = [] if baseline == checksum else ["*"]
        elif isinstance(baseline, dict) and all(isinstance(v, str) for v in baseline.values()):
            mismatches = sorted(
                name
                for name in set(baseline) | set(digests)
                if baseline.get(name) != digests.get(name)
            )
        else:
            raise InvalidRequestError(
                "'baseline' must map tensor names to digests, or be a model checksum",
                param="baseline",
                code="invalid_value",
            )
        if mismatches:
            raise InvalidRequestError(
                _mismatch_message(mismatches),
                param="baseline",
                code="weights_mismatch",
                extra={"success": False, "mismatches": mismatches},
            )
        return {"success": True, "match": True, "mismatches": []}


def _mismatch_message(mismatches: list[str]) -> str:
    if mismatches == ["*"]:
        return "the model's checksum differs from the baseline checksum"
    named = ", ".join(mismatches[:MAX_NAMED_MISMATCHES])
    more = len(mismatches) - MAX_NAMED_MISMATCHES
    return f"the weights differ from the baseline in {len(mismatches)} tensor(s): {named}" + (
        f" and {more} more" if more > 0 else ""
    )
