"""Media for multimodal models (``dynamo.common.multimodal``) and the media codecs.

``encoding`` and ``limits`` (codecs, data URLs, video/image limits) are imported
directly. The names below load their module on first use, so importing the codecs never
imports torch or an HTTP library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from penstock.multimodal.audio_loader import AudioLoader
    from penstock.multimodal.encoder_cache import AsyncEncoderCache
    from penstock.multimodal.image_loader import ImageLoader
    from penstock.multimodal.transfer import (
        AbstractEmbeddingReceiver,
        AbstractEmbeddingSender,
        EmbeddingTransferMode,
        LocalEmbeddingReceiver,
        LocalEmbeddingSender,
        NixlReadEmbeddingReceiver,
        NixlReadEmbeddingSender,
        NixlWriteEmbeddingReceiver,
        NixlWriteEmbeddingSender,
        TransferRequest,
        create_embedding_receiver,
        create_embedding_sender,
    )

__all__ = [
    "AbstractEmbeddingReceiver",
    "AbstractEmbeddingSender",
    "AsyncEncoderCache",
    "AudioLoader",
    "EmbeddingTransferMode",
    "ImageLoader",
    "LocalEmbeddingReceiver",
    "LocalEmbeddingSender",
    "NixlReadEmbeddingReceiver",
    "NixlReadEmbeddingSender",
    "NixlWriteEmbeddingReceiver",
    "NixlWriteEmbeddingSender",
    "TransferRequest",
    "create_embedding_receiver",
    "create_embedding_sender",
]


# The module of each name above; the embedding transfer names are all in ``transfer``.
_MODULES = {
    "AudioLoader": "audio_loader",
    "ImageLoader": "image_loader",
    "AsyncEncoderCache": "encoder_cache",
}


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _MODULES.get(name, "transfer")
    return getattr(importlib.import_module(f"penstock.multimodal.{module}"), name)
