"""Serving-role enums shared by engines and the gateway.

Seed parity: ``EmbeddingTransferMode`` is the ``dynamo.common.constants`` enum for engines
written against Dynamo; the gateway does not use it itself.
"""

from enum import Enum


class DisaggregationMode(Enum):
    """Which stage of a disaggregated pipeline a worker serves."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


class EmbeddingTransferMode(Enum):
    """How precomputed multimodal embeddings move between workers."""

    LOCAL = "local"
    NIXL_WRITE = "nixl-write"
    NIXL_READ = "nixl-read"


class ModelInput(Enum):
    """What the gateway hands an engine: token ids (LLM) or the raw JSON body (media)."""

    Tokens = "tokens"
    Text = "text"
    Tensor = "tensor"
