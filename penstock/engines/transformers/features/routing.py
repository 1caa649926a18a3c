"""The experts a mixture-of-experts model routes each token to, recorded as its forward
passes run (vLLM's ``routed_experts``, which SkyRL replays in training).

transformers' MoE routers (``Qwen2MoeTopKRouter``, ``MixtralTopKRouter``, ...) return the
indices of the experts each token goes to, beside the logits and weights. A forward hook
on every router keeps those indices, layer by layer, while :meth:`ExpertRecorder.capture`
is open: ``[tokens, MoE layers, top_k]`` for the pass, the experts that computed it.

Only ``--deterministic`` records (:class:`.deterministic.DeterministicRunner`): there
each forward pass runs one sequence, unpadded and without a cached prefix, so every token
of the pass is that sequence's own. A batched pass mixes rows and padding tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _routers(model: Any) -> list[torch.nn.Module]:
    return [
        module
        for module in model.modules()
        if type(module).__name__.endswith("Router")
        and hasattr(module, "top_k")
        and hasattr(module, "num_experts")
    ]


class ExpertRecorder:
    """Hooks on one model's routers; :meth:`for_model` is None for a dense model."""

    def __init__(self, model: Any) -> None:
        self._model: Any = None
        self._layers: list[torch.Tensor] | None = None
        self._hook(model)

    @classmethod
    def for_model(cls, model: Any) -> ExpertRecorder | None:
        return cls(model) if _routers(model) else None

    def _hook(self, model: Any) -> None:
        for router in _routers(model):
            router.register_forward_hook(self._record)
        self._model = model

    def _record(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._layers is not None and isinstance(output, tuple):
            self._layers.append(output[-1].detach().to("cpu", torch.int32))

    @contextmanager
    def capture(self, model: Any) -> Iterator[list[torch.Tensor]]:
        """Record the forward passes run inside; the list then holds one ``[tokens,
        layers, top_k]`` tensor. ``model`` is the base model now served: one rebuilt since
        (a level-2 sleep reloads it) gets hooks of its own."""
        base = getattr(model, "get_base_model", lambda: model)()
        if base is not self._model:
            self._hook(base)
        self._layers = []
        routes: list[torch.Tensor] = []
        try:
            yield routes
        finally:
            layers, self._layers = self._layers, None
            if layers:
                routes.append(torch.stack(layers, dim=1))
