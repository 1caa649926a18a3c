"""Vision-language checkpoints in the transformers engine: images to prefill embeddings.

A checkpoint whose config has a ``vision_config`` is loaded as an image-text-to-text model
(LLaVA-style: a vision tower and a projector whose per-image features replace the
image placeholder tokens of the prompt, and a text model with plain 1-D positions, so
after prefill the model decodes exactly as its text model does and the scheduler's
decode path needs nothing new).

The gateway has already fetched and decoded each image (``multi_modal_data["image_url"]``,
``{"Decoded": <RGB PIL image>}`` items) and rendered one placeholder token per image
where the chat template put the image. :meth:`VisionEncoder.prepare` expands every
placeholder to the image's feature length and hands the scheduler a function that
builds the prompt's ``inputs_embeds`` at prefill time, on the scheduler thread, with the
weights live at that moment.

Image features are computed once per distinct image: the key is a hash of the decoded
pixels, the features live in a byte-bounded LRU (:class:`MultimodalEmbeddingCacheManager`)
behind an :class:`AsyncEncoderCache`, so a repeated image, or the same image in two
concurrent requests, runs the vision tower once. ``encoder_calls`` and ``cache_hits``
count images encoded and images served from the cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from penstock.engines.transformers.weights.checkpoint import CheckpointError
from penstock.memory import CachedEmbedding, MultimodalEmbeddingCacheManager
from penstock.multimodal import AsyncEncoderCache

if TYPE_CHECKING:
    from PIL import Image

# Families whose features replace one placeholder token each and whose text model uses
# 1-D positions; others (M-RoPE, tiled images) need prefill logic of their own.
SUPPORTED_MODEL_TYPES = frozenset({"llava"})

Embed = Callable[[Any, torch.Tensor], torch.Tensor]


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def check_vision_config(config: Any) -> None:
    """Refuse, before loading, a vision-language family this engine cannot prefill."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise CheckpointError(
            f"vision-language model type {model_type!r} is not supported by the "
            f"transformers engine (supported: {supported})"
        )
    if _image_token_id(config) is None:
        raise CheckpointError(f"the {model_type} config declares no image_token_id")


def _image_token_id(config: Any) -> int | None:
    value = getattr(config, "image_token_id", None)
    if value is None:
        value = getattr(config, "image_token_index", None)
    return value if isinstance(value, int) else None


def load_vision_model(path: Path, *, dtype: torch.dtype, device: torch.device) -> Any:
    """Load an image-text-to-text model for inference; failures become a ``CheckpointError``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForImageTextToText

    try:
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=dtype, local_files_only=True
        )
    except Exception as exc:
        raise CheckpointError(f"cannot load the model checkpoint at {path}: {exc}") from exc
    return model.to(device).eval()


def image_key(image: Image.Image) -> str:
    """A content hash of the decoded pixels: equal images share features whatever bytes
    (format, URL, data URL) they arrived as."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class VisionEncoder:
    """Image features with a content-hash cache, and the prompt expansion that uses them."""

    def __init__(
        self,
        model_path: Path,
        config: Any,
        *,
        model: Callable[[], Any],
        step_lock: threading.Lock,
        device: torch.device,
        dtype: torch.dtype,
        cache_bytes: int,
    ) -> None:
        from transformers import AutoImageProcessor

        try:
            self.processor = AutoImageProcessor.from_pretrained(model_path, local_files_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"cannot read the image processor of {model_path} (preprocessor_config.json): {exc}"
            ) from exc
        image_token_id = _image_token_id(config)
        if image_token_id is None:
            raise CheckpointError(f"the config of {model_path} declares no image_token_id")
        self.image_token_id = image_token_id
        self.feature_layer = config.vision_feature_layer
        self.feature_strategy = config.vision_feature_select_strategy
        self._model = model
        self._step_lock = step_lock
        self.device = device
        self.dtype = dtype
        self.cache_bytes = cache_bytes
        self.cache = AsyncEncoderCache(MultimodalEmbeddingCacheManager(cache_bytes))
        self.encoder_calls = 0
        self.cache_hits = 0

    async def prepare(
        self, prompt: list[int], multi_modal_data: Any
    ) -> tuple[list[int], Embed | None]:
        """The prompt with each placeholder expanded to its image's feature length, and the
        embedding function its prefill runs (None without images)."""
        images = _images_of(multi_modal_data)
        placeholders = prompt.count(self.image_token_id)
        if not images:
            if placeholders:
                raise ValueError(
                    f"token_ids: the prompt holds {placeholders} image placeholder token(s) "
                    "but the request carries no image"
                )
            return prompt, None
        if placeholders != len(images):
            raise ValueError(
                f"token_ids: the prompt holds {placeholders} image placeholder token(s) for "
                f"{len(images)} image(s); the chat template must place one per image part"
            )
        keys = await asyncio.to_thread(lambda: [image_key(image) for image in images])
        features = list(
            await asyncio.gather(
                *(self._features(key, image) for key, image in zip(keys, images, strict=True))
            )
        )
        return self._expand(prompt, features), self._embedder(features)

    async def _features(self, key: str, image: Image.Image) -> torch.Tensor:
        computed = False

        async def compute() -> CachedEmbedding:
            nonlocal computed
            computed = True
            return CachedEmbedding(await asyncio.to_thread(self.encode, image))

        entry = await self.cache.get_or_compute(key, compute)
        if not computed:
            self.cache_hits += 1
        return entry.tensor

    def encode(self, image: Image.Image) -> torch.Tensor:
        """``[tokens, hidden]`` features of one image (runs the vision tower)."""
        pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        # Under the step lock no forward pass runs and the weights cannot change midway.
        with self._step_lock, torch.inference_mode():
            model = self._model()
            if model is None:
                raise RuntimeError("the weights are asleep: call wake_up before sending images")
            output = model.get_image_features(
                pixel_values=pixels.to(self.device, self.dtype),
                vision_feature_layer=self.feature_layer,
                vision_feature_select_strategy=self.feature_strategy,
            )
            self.encoder_calls += 1
        features = output.pooler_output if hasattr(output, "pooler_output") else output
        if isinstance(features, list | tuple):
            features = features[0]
        return features.reshape(-1, features.shape[-1]).contiguous()

    def forget(self) -> None:
        """Drop every cached feature: new weights make them stale."""
        self.cache = AsyncEncoderCache(MultimodalEmbeddingCacheManager(self.cache_bytes))

    def _expand(self, prompt: list[int], features: list[torch.Tensor]) -> list[int]:
        expanded: list[int] = []
        remaining = iter(features)
        for token in prompt:
            if token == self.image_token_id:
                expanded += [token] * next(remaining).shape[0]
            else:
                expanded.append(token)
        return expanded

    def _embedder(self, features: list[torch.Tensor]) -> Embed:
        image_token_id = self.image_token_id

        def embed(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
            embeds = model.get_input_embeddings()(input_ids)
            mask = input_ids == image_token_id
            stacked = torch.cat(features).to(embeds.device, embeds.dtype)
            return embeds.masked_scatter(mask.unsqueeze(-1), stacked)

        return embed

    def prometheus_lines(self, label: str) -> list[str]:
        stats = self.cache.stats
        families = (
            (
                "penstock_engine_vision_encoder_calls_total",
                "counter",
                "Images run through the vision tower",
                self.encoder_calls,
            ),
            (
                "penstock_engine_vision_encoder_cache_hits_total",
                "counter",
                "Images whose features came from the encoder cache",
                self.cache_hits,
            ),
            (
                "penstock_engine_vision_encoder_cache_bytes",
                "gauge",
                "Bytes of image features held by the encoder cache",
                stats["current_bytes"],
            ),
        )
        lines: list[str] = []
        for name, kind, help_text, value in families:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} {kind}",
                f'{name}{{model="{label}"}} {value}',
            ]
        return lines


def _images_of(multi_modal_data: Any) -> list[Image.Image]:
    if multi_modal_data is None:
        return []
    if not isinstance(multi_modal_data, dict):
        raise ValueError("multi_modal_data must be an object")
    unsupported = sorted(set(multi_modal_data) - {"image_url"})
    if unsupported:
        raise ValueError(f"multi_modal_data: this model takes images only, not {unsupported}")
    images = []
    for index, item in enumerate(multi_modal_data.get("image_url") or []):
        image = item.get("Decoded") if isinstance(item, dict) else None
        if image is None or not hasattr(image, "tobytes"):
            raise ValueError(
                f"multi_modal_data.image_url[{index}]: expected a decoded image "
                "({'Decoded': <PIL image>})"
            )
        images.append(image.convert("RGB") if image.mode != "RGB" else image)
    return images
