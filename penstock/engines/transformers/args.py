"""Command line of the transformers engine, built from its declared options
(:data:`penstock.engines.builtin_options.TRANSFORMERS`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from penstock.engines.builtin_options import TRANSFORMERS, default_model_cache_dir
from penstock.engines.engine_options import engine_parser


@dataclass(frozen=True)
class EngineArgs:
    """Parsed engine options; None means "derive from the checkpoint"."""

    model: Path | None
    served_model_name: str | None
    device: str
    dtype: str
    max_num_seqs: int
    max_model_len: int | None
    kv_cache_tokens: int | None
    seed: int
    model_cache_dir: Path
    health_check_payload: str | None
    cpu_threads: int | None = None
    generation_config: str = "auto"
    encoder_cache_bytes: int = 256 * 1024 * 1024
    cpu_weight_dtype: str = "auto"
    cpu_activation_dtype: str = "float32"
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    deterministic: bool = False
    decode_gap_ratio: float = 2.0
    grammar_compile_timeout: float = 10.0

    def kv_pool_tokens(self, *, bytes_per_token: int, default: int) -> int:
        """The KV pool's size in tokens: ``--kv-cache-tokens``, or ``--kv-cache-bytes`` at
        ``bytes_per_token``, or ``default``."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        if self.kv_cache_bytes is not None:
            return max(self.kv_cache_bytes // max(bytes_per_token, 1), 1)
        return default


def context_length(asked: int | None, limit: int | None) -> int:
    """The longest input: ``--max-model-len`` (``asked``) within the model's positions
    (``limit``, its ``max_position_embeddings``), else those."""
    longest = asked if asked is not None else limit
    if longest is None:
        raise ValueError("the model config has no max_position_embeddings; pass --max-model-len")
    if limit is not None and longest > limit:
        raise ValueError(
            f"--max-model-len {longest} exceeds the model's max_position_embeddings of {limit}"
        )
    return int(longest)


def build_parser() -> argparse.ArgumentParser:
    return engine_parser(TRANSFORMERS)


def parse_args(argv: list[str]) -> EngineArgs:
    """Parse ``argv``; bad options print usage and raise ``SystemExit(2)``."""
    namespace = build_parser().parse_args(argv)
    return EngineArgs(
        model=namespace.model.expanduser() if namespace.model is not None else None,
        served_model_name=namespace.served_model_name,
        device=namespace.device,
        dtype=namespace.dtype,
        max_num_seqs=namespace.max_num_seqs,
        max_model_len=namespace.max_model_len,
        kv_cache_tokens=namespace.kv_cache_tokens,
        seed=namespace.seed,
        model_cache_dir=(namespace.model_cache_dir or default_model_cache_dir()).expanduser(),
        health_check_payload=namespace.health_check_payload,
        cpu_threads=namespace.cpu_threads,
        generation_config=namespace.generation_config,
        encoder_cache_bytes=namespace.encoder_cache_bytes,
        cpu_weight_dtype=namespace.cpu_weight_dtype,
        cpu_activation_dtype=namespace.cpu_activation_dtype,
        kv_cache_bytes=namespace.kv_cache_bytes,
        enable_prefix_caching=namespace.enable_prefix_caching,
        max_num_batched_tokens=namespace.max_num_batched_tokens,
        deterministic=namespace.deterministic,
        decode_gap_ratio=namespace.decode_gap_ratio,
        grammar_compile_timeout=namespace.grammar_compile_timeout,
    )
