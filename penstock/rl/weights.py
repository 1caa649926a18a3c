"""Weight pushes and their verification, the same for every admin dialect.

* :func:`tensor_update_body`: an ``update_weights_from_tensor`` body as the engine gets it.
  A pickled entry on a server without ``--trust-weight-payloads`` is a 400 naming the flag
  before the engine sees it; the trust the engine is told is the operator's, never the
  client's.
* :class:`WeightsChecker`: ``weights_checker`` (``checksum``, ``compare``, ``reset``) over
  the engine's ``weights_checksum`` control. ``checksum`` also keeps the result as the
  baseline; ``compare`` checks against the body's ``baseline`` (``{name: digest}``, or a
  checksum string for the whole model) or else the kept one; ``reset`` forgets it. The
  algorithm is in :mod:`penstock.engines.weight_sync`.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Any

from penstock.engines.weight_sync import TRUST_FLAG, is_pickled
from penstock.errors import ConflictError, InvalidRequestError

if TYPE_CHECKING:
    from penstock.rl.state import AdminStateMachine

TRUST_KEY = "trust_weight_payloads"
CHECKER_ACTIONS = ("checksum", "compare", "reset")


def tensor_update_body(body: dict[str, Any], *, trusted: bool) -> dict[str, Any]:
    payloads = body.get("serialized_named_tensors")
    if payloads is None and "named_tensors" in body:
        # The sample engine's JSON form: plain numbers, nothing to unpickle.
        return {k: v for k, v in body.items() if k != TRUST_KEY}
    if not isinstance(payloads, list) or not payloads:
        raise InvalidRequestError(
            "'serialized_named_tensors' must be a non-empty list of base64 strings",
            param="serialized_named_tensors",
            code="invalid_value",
        )
    for entry in payloads:
        if not isinstance(entry, str):
            raise InvalidRequestError(
                "'serialized_named_tensors' must hold base64 strings",
                param="serialized_named_tensors",
                code="invalid_value",
            )
        try:
            head = base64.b64decode(entry[:8], validate=True)
        except (binascii.Error, ValueError):
            head = b""
        if is_pickled(head) and not trusted:
            raise InvalidRequestError(
                "'serialized_named_tensors' holds a pickled payload, and unpickling runs code "
                "the sender chose: send base64 safetensors bytes, or start the server with "
                f"{TRUST_FLAG} if this trainer is trusted",
                param="serialized_named_tensors",
                code="untrusted_payload",
            )
    return {**{k: v for k, v in body.items() if k != TRUST_KEY}, TRUST_KEY: trusted}


class WeightsChecker:
    def __init__(self, state: AdminStateMachine) -> None:
        self.state = state
        self.baseline: dict[str, str] | None = None
        self.baseline_checksum: str | None = None

    async def _checksum(self) -> dict[str, Any]:
        if self.state.is_sleeping and "weights" in self.state.sleep_tags:
            raise self.state.conflict("the weights are asleep: wake_up before checking them")
        return await self.state.run_control("weights_checksum", {})

    async def run(self, body: dict[str, Any]) -> dict[str, Any]:
        action = body.get("action", "checksum")
        if action not in CHECKER_ACTIONS:
            raise InvalidRequestError(
                f"'action' must be one of {', '.join(CHECKER_ACTIONS)}; got {action!r}",
                param="action",
                code="invalid_value",
            )
        if action == "reset":
            self.baseline = self.baseline_checksum = None
            return {"status": "reset", "success": True}
        result = await self._checksum()
        digests: dict[str, str] = result.get("tensors", {})
        checksum = result.get("checksum")
        if action == "checksum":
            self.baseline, self.baseline_checksum = dict(digests), checksum
            return {
                "success": True,
                "checksum": checksum,
                "checksums": digests,
                "weight_version": self.state.weight_version,
            }
        return self._compare(body.get("baseline"), digests, checksum)

    def _compare(self, baseline: Any, digests: dict[str, str], checksum: Any) -> dict[str, Any]:
        if baseline is None:
            if self.baseline is None:
                raise ConflictError(
                    "no baseline to compare with: send 'baseline' or call action checksum first",
                    code="no_baseline",
                )
            baseline = self.baseline
        if isinstance(baseline, str):
            match = baseline == checksum
            return {"success": True, "match": match, "mismatches": [] if match else ["*"]}
        if not isinstance(baseline, dict) or not all(isinstance(v, str) for v in baseline.values()):
            raise InvalidRequestError(
                "'baseline' must map tensor names to digests, or be a model checksum",
                param="baseline",
                code="invalid_value",
            )
        mismatches = sorted(
            name for name in set(baseline) | set(digests) if baseline.get(name) != digests.get(name)
        )
        return {"success": True, "match": not mismatches, "mismatches": mismatches}
