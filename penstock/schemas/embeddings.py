"""Request bodies of ``/v1/embeddings`` (OpenAI) and vLLM's ``/classify`` and ``/pooling``.

``input`` takes every form OpenAI allows: a string, a list of strings, a list of token ids,
or a list of token-id lists. Undeclared fields are refused, so a misspelt option is a 400
naming it rather than ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict

from penstock.schemas.openai import NonNegativeInt
from penstock.schemas.unicode import RequestModel

PoolingInput = str | list[str] | list[NonNegativeInt] | list[list[NonNegativeInt]]
EncodingFormat = Literal["float", "base64"]


class PoolingFields(RequestModel):
    """What every pooling route reads: the model, the inputs and how to tokenize them."""

    model_config = ConfigDict(extra="forbid")

    # Left out or empty: the served model, as in vLLM.
    model: str = ""
    input: PoolingInput
    user: str | None = None
    # vLLM's option: whether a text input gets the special tokens the tokenizer adds
    # around it (``[CLS]`` ... ``[SEP]``, a BOS). Token-id inputs are used as given.
    add_special_tokens: bool = True


class EmbeddingRequest(PoolingFields):
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None


class ClassificationRequest(PoolingFields):
    # vLLM's option: False gives the raw logits (a reward model's score) instead of
    # probabilities (softmax, or sigmoid for a single class).
    use_activation: bool = True


class PoolingRequest(ClassificationRequest):
    task: Literal["embed", "classify"] | None = None
    encoding_format: EncodingFormat = "float"
