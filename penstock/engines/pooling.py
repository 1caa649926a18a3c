"""How a token engine serves embeddings and sequence scores within the engine contract.

A pooling engine is an :class:`~penstock.engines.contract.LLMEngine` whose worker declares
the ``embeddings`` endpoint type (Dynamo's ``ModelType.Embedding``) and whose
:class:`~penstock.engines.contract.EngineConfig` advertises, under
``runtime_data[POOLING_RUNTIME_KEY]``, what it pools: its tasks (``embed``, ``classify``),
the length of its vectors and the labels of its classes.

One HTTP request is one engine request, as Dynamo's ``PreprocessedEmbeddingRequest``
carries it: ``token_ids`` holds one token-id list per input (not one list), and
``pooling_task`` says which task. The engine answers with one terminal chunk
(``finish_reason`` ``"stop"``, no tokens) carrying ``embeddings``: one vector per input, in
input order: the normalised embedding for ``embed``, the raw logits of every class for
``classify`` (activations are the gateway's, per request). ``prompt_tokens`` counts the
tokens it read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict

POOLING_RUNTIME_KEY = "pooling"

PoolingTask = Literal["embed", "classify"]
POOLING_TASKS: tuple[PoolingTask, ...] = ("embed", "classify")


class PoolingRequest(TypedDict, total=False):
    """What :meth:`LLMEngine.generate` of a pooling engine receives."""

    token_ids: list[list[int]]
    model: str
    pooling_task: PoolingTask


class PoolingChunk(TypedDict, total=False):
    """The one chunk a pooling engine yields per request."""

    token_ids: list[int]
    index: int
    finish_reason: str
    embeddings: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class PoolingCapabilities:
    """What a pooling engine advertised: its tasks, vector length and class labels."""

    tasks: frozenset[str]
    dimensions: int
    labels: tuple[str, ...] = ()

    def advertise(self) -> dict[str, Any]:
        """The JSON-safe form an engine puts under ``runtime_data[POOLING_RUNTIME_KEY]``."""
        return {
            "tasks": sorted(self.tasks),
            "dimensions": self.dimensions,
            "labels": list(self.labels),
        }


def pooling_capabilities(runtime_data: dict[str, Any] | None) -> PoolingCapabilities | None:
    """What an engine advertised under ``POOLING_RUNTIME_KEY``; None when it pools nothing
    or the advertisement does not parse."""
    advertised = (runtime_data or {}).get(POOLING_RUNTIME_KEY)
    if not isinstance(advertised, dict):
        return None
    tasks = advertised.get("tasks")
    dimensions = advertised.get("dimensions")
    labels = advertised.get("labels") or []
    if (
        not isinstance(tasks, list)
        or not isinstance(dimensions, int)
        or dimensions <= 0
        or not all(isinstance(label, str) for label in labels)
    ):
        return None
    known = frozenset(task for task in tasks if task in POOLING_TASKS)
    if not known:
        return None
    return PoolingCapabilities(tasks=known, dimensions=dimensions, labels=tuple(labels))
