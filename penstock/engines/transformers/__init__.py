"""The ``transformers`` engine: local Hugging Face causal LMs with continuous batching."""

from penstock.engines.transformers.engine import TransformersEngine

__all__ = ["TransformersEngine"]
