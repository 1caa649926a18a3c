"""LoRA adapters: fetching them by URI (LoRAManager) and the helpers it is built on."""

from penstock.lora.manager import LoRAInfo, LoRAManager, default_cache_root, uri_to_cache_key
from penstock.lora.once import OnceLock
from penstock.lora.sources import (
    HfCacheSource,
    LocalSource,
    LoRASourceProtocol,
    S3Source,
    is_adapter_folder,
)

__all__ = [
    "HfCacheSource",
    "LoRAInfo",
    "LoRAManager",
    "LoRASourceProtocol",
    "LocalSource",
    "OnceLock",
    "S3Source",
    "default_cache_root",
    "is_adapter_folder",
    "uri_to_cache_key",
]
