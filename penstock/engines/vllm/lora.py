"""LoRA adapters on the vllm engine: vLLM's own LoRA support (``--enable-lora``).

* ``load_lora {lora_name, lora_path}``: ``AsyncLLM.add_lora`` with a ``LoRARequest`` of a
  fresh id; vLLM reads the folder then (a folder it cannot load, or of a rank over
  ``--max-lora-rank``, is a 400 with vLLM's reason).
* ``unload_lora {lora_name}``: ``AsyncLLM.remove_lora``.
* A generation request whose ``model`` names a loaded adapter runs with its
  ``LoRARequest``; the served model's own names run the base model.

A server started without ``--enable-lora`` refuses both with the reason, as vLLM builds
its LoRA layers only at start. vLLM's CPU build runs LoRA through its torch kernels (no
compiled graphs: vLLM turns compilation off with LoRA on the CPU). A weight update
evicts vLLM's loaded adapters; each is read again from its folder by the next request
that names it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from vllm.lora.request import LoRARequest

from penstock.engines.controls import Body, ControlRejected, Handler

LORA_OFF_REFUSAL = (
    "LoRA adapters need vLLM's LoRA layers, which it builds only at start: start the server "
    "with --enable-lora (and --max-lora-rank at least the adapter's rank)"
)


def _name(body: Body) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ControlRejected("missing non-empty `lora_name` string", field="lora_name")
    return name


class VllmAdapters:
    """LoRA load, unload and per-request selection on ``AsyncLLM`` (mixed into the engine)."""

    _require_llm: Callable[[], Any]
    engine_args: Any

    def __init__(self) -> None:
        self.loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)

    def lora_updates(self) -> dict[str, Handler]:
        return {"load_lora": self._load_lora, "unload_lora": self._unload_lora}

    def _require_lora(self) -> Any:
        if not self.engine_args.enable_lora:
            raise ControlRejected(LORA_OFF_REFUSAL)
        return self._require_llm()

    async def _load_lora(self, body: Body) -> Body:
        name = _name(body)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ControlRejected("missing non-empty `lora_path` string", field="lora_path")
        llm = self._require_lora()
        if name in self.loras:
            raise ControlRejected(
                f"LoRA adapter '{name}' is already loaded from "
                f"{self.loras[name].lora_path}; unload it first"
            )
        request = LoRARequest(lora_name=name, lora_int_id=next(self._lora_ids), lora_path=path)
        try:
            added = await llm.add_lora(request)
        except Exception as exc:
            raise ControlRejected(f"LoRA adapter '{name}' not loaded: {exc}") from exc
        if not added:
            raise ControlRejected(f"LoRA adapter '{name}' not loaded: vLLM refused it")
        self.loras[name] = request
        return {
            "status": "ok",
            "message": f"LoRA adapter '{name}' loaded",
            "lora_name": name,
            "lora_path": path,
        }

    async def _unload_lora(self, body: Body) -> Body:
        name = _name(body)
        llm = self._require_lora()
        request = self.loras.pop(name, None)
        if request is None:
            loaded = ", ".join(sorted(self.loras)) or "none"
            raise ControlRejected(f"LoRA adapter '{name}' is not loaded (loaded: {loaded})")
        # vLLM may have evicted it already (a weight update does): nothing left to remove.
        await llm.remove_lora(request.lora_int_id)
        return {"status": "ok", "message": f"LoRA adapter '{name}' unloaded", "lora_name": name}

    def lora_request(self, model: Any) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (the gateway
        resolves every other name to it, and 404s names it does not serve)."""
        if not isinstance(model, str):
            return None
        return self.loras.get(model)
