"""Command line of the transformers engine."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

MODEL_CACHE_ENV = "PENSTOCK_MODEL_CACHE"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "gguf")
CPU_ACTIVATION_DTYPES = ("float32", "bfloat16")


def default_model_cache_dir() -> Path:
    configured = os.environ.get(MODEL_CACHE_ENV, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "penstock" / "models"


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


def _ratio_above_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {text!r}") from None
    if not value > 1:
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


_CPU_WEIGHT_DTYPE_HELP = (
    "on cpu with float32 compute, the dtype linear and embedding weights are stored "
    "in; arithmetic stays float32, so bfloat16 halves the bytes a decode step reads and "
    "loses nothing for a checkpoint stored in bfloat16 (weight updates are rounded to "
    "bfloat16). Needs AVX-512 or AVX2 + FMA and a C++ compiler (one build of about "
    "a CPU minute into --model-cache-dir); without them weights stay float32. "
    "gguf = bfloat16, and linear layers decode from the GGUF blocks (Q4_1, Q8_0) "
    "the checkpoint was converted from, "
    "kept beside it as gguf_blocks.st (the default model's are): each layer "
    "only where its blocks rebuild its weight bit for bit, so lossless, ~0.8 bytes a "
    "weight; needs AVX512-BF16, else bfloat16. int8 = bfloat16 plus an "
    "int8 copy of each linear weight (one scale per 64 weights) that decoding reads: "
    "~1.8x faster linears, not lossless (greedy output can differ from float32; see "
    "bench/README.md). auto = gguf where the folder has GGUF blocks, else bfloat16, when "
    "the checkpoint is stored in bfloat16 (default: auto)"
)
_CPU_ACTIVATION_DTYPE_HELP = (
    "on cpu with bfloat16 or gguf weights: bfloat16 rounds each activation row to "
    "bfloat16 before the linear layers' kernels multiply (AVX512-BF16 dot products: "
    "gguf linears ~1.7x faster at 16 rows, bfloat16 ~1.1x; one row stays float32). "
    "Lossy, as a GPU running the model in bfloat16: greedy output can differ from "
    "float32 and from generate; without AVX512-BF16 activations stay float32. "
    "float32 = exact (default: float32)"
)
_GENERATION_CONFIG_HELP = (
    "where the default sampling parameters (temperature, top_p, top_k, min_p, "
    "repetition_penalty, max_new_tokens) of requests that don't set them come from: "
    "auto = the model folder's generation_config.json; vllm = ignore it and use neutral "
    "defaults (temperature 1, no top-p/top-k/min-p, no repetition penalty, generate up "
    "to the context length); PATH = the generation_config.json in folder PATH "
    "(default: auto)"
)


def _add_kv_options(parser: argparse.ArgumentParser) -> None:
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-cache-tokens",
        type=_positive_int,
        help="KV pool size in tokens across all sequences and cached prefixes, whose keys "
        "and values are allocated once at that size and used in place "
        "(default: max-num-seqs x max-model-len, at most a quarter of the device's memory)",
    )
    pool.add_argument(
        "--kv-cache-bytes",
        type=_positive_int,
        help="KV pool size in bytes of keys and values (instead of --kv-cache-tokens)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prompt blocks seen before (default: on)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=2048,
        help="tokens one step computes at most, decode rows and prefill chunks together; "
        "a longer prompt is prefilled over several steps (default: 2048)",
    )
    parser.add_argument(
        "--decode-gap-ratio",
        type=_ratio_above_one,
        default=2.0,
        help="on cpu, while rows decode, a step that also prefills part of a longer prompt "
        "aims at this many times the time of a step of the rows alone (measured as it "
        "runs): higher prefills the prompt sooner and spaces the decoding streams' tokens "
        "further apart (default: 2.0)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="penstock serve --engine transformers",
        description="Serve a local Hugging Face causal-LM checkpoint with continuous batching.",
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="folder of a Hugging Face causal-LM checkpoint (default: the embedded "
        "SmolLM2-135M-Instruct, converted once into --model-cache-dir)",
    )
    parser.add_argument("--served-model-name", help="name clients use in 'model'")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="auto = cuda if present")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto = float32 on cpu, the checkpoint's half precision (else bfloat16) on cuda",
    )
    parser.add_argument(
        "--max-num-seqs", type=_positive_int, default=16, help="sequences decoded together"
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        help="context length in tokens (default: the model's max_position_embeddings)",
    )
    _add_kv_options(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without a seed")
    parser.add_argument(
        "--model-cache-dir",
        type=Path,
        default=None,
        help=f"where converted models live (default: ${MODEL_CACHE_ENV} or "
        "~/.cache/penstock/models)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=_positive_int,
        help="torch intra-op threads on cpu (default: torch's choice); 1 avoids spin-waiting "
        "on cores other processes keep busy",
    )
    parser.add_argument(
        "--cpu-weight-dtype",
        choices=CPU_WEIGHT_DTYPES,
        default="auto",
        help=_CPU_WEIGHT_DTYPE_HELP,
    )
    parser.add_argument(
        "--cpu-activation-dtype",
        choices=CPU_ACTIVATION_DTYPES,
        default="float32",
        help=_CPU_ACTIVATION_DTYPE_HELP,
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|PATH",
        help=_GENERATION_CONFIG_HELP,
    )
    parser.add_argument(
        "--encoder-cache-bytes",
        type=_positive_int,
        default=256 * 1024 * 1024,
        help="bytes of image features a vision-language model keeps, so a repeated image "
        "skips the vision tower (default: 268435456, 256 MiB)",
    )
    parser.add_argument(
        "--health-check-payload", help="canary request JSON or @file (replaces the default)"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="one sequence per forward pass, no prefix cache, float32 weights on cpu, and "
        "logprobs recomputed by one forward pass over prompt and completion: a request's "
        "output does not depend on what runs beside it, and its logprobs equal a trainer's "
        "forward pass (see penstock serve --deterministic)",
    )
    return parser


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
    )
