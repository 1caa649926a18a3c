"""The built-in engines and every option each one takes, declared once (see
:mod:`penstock.engines.engine_options` for what is derived from them), and the vLLM
options a vLLM user may type that Penstock does not implement."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from penstock.engines.engine_options import BuiltinEngine, EngineOption

MODEL_CACHE_ENV = "PENSTOCK_MODEL_CACHE"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of the same dtypes.
DTYPE_SYNONYMS = {"half": "float16", "float": "float32"}
CPU_WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "gguf")
CPU_ACTIVATION_DTYPES = ("float32", "bfloat16")
POOLING_TASKS = ("auto", "embed", "classify")
POOLING_METHODS = ("auto", "cls", "mean", "last", "max")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def ratio_above_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {text!r}") from None
    if not value > 1:
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {value}")
    return value


def dtype_name(text: str) -> str:
    """A dtype as the engines name it; vLLM's ``half`` and ``float`` included."""
    return DTYPE_SYNONYMS.get(text, text)


def default_model_cache_dir() -> Path:
    configured = os.environ.get(MODEL_CACHE_ENV, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "penstock" / "models"


_HEALTH_CHECK_PAYLOAD = EngineOption(
    "--health-check-payload",
    "canary request JSON or @file; replaces the engine's",
    shown_default="the engine's",
)
_SERVED_MODEL_NAME = EngineOption(
    "--served-model-name", "name clients use in 'model'", shown_default="the model's"
)
_DTYPE = EngineOption(
    "--dtype",
    "auto = float32 on cpu, the checkpoint's half precision (else bfloat16) on cuda; "
    "half = float16, float = float32",
    type=dtype_name,
    default="auto",
    choices=DTYPES,
)
_CPU_THREADS = EngineOption(
    "--cpu-threads",
    "intra-op threads on cpu, torch's and the C++ kernels' (torch's choice: one per core "
    "it may use); the C++ kernels' helper threads take work only while they have a core, "
    "so a core busy elsewhere does not stall a step",
    type=positive_int,
    shown_default="torch's choice",
)
_ENDPOINT_TYPES_HELP = "endpoint types the engine registers, comma-separated"

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
    "weight; needs AVX512-BF16 or AVX2, else bfloat16. int8 = bfloat16 plus an "
    "int8 copy of each linear weight (one scale per 64 weights) that decoding reads: "
    "~1.8x faster linears, not lossless (greedy output can differ from float32; see "
    "bench/README.md). auto = gguf where the folder has GGUF blocks and the CPU "
    "AVX512-BF16 (on AVX2 they are no faster), else bfloat16, when the checkpoint is "
    "stored in bfloat16"
)
_CPU_ACTIVATION_DTYPE_HELP = (
    "on cpu with bfloat16 or gguf weights: bfloat16 rounds each activation row to "
    "bfloat16 before the linear layers' kernels multiply (AVX512-BF16 dot products: "
    "gguf linears ~1.7x faster at 16 rows, bfloat16 ~1.1x; one row stays float32). "
    "Lossy, as a GPU running the model in bfloat16: greedy output can differ from "
    "float32 and from generate; without AVX512-BF16 activations stay float32. "
    "float32 = exact"
)
_GENERATION_CONFIG_HELP = (
    "where the default sampling parameters (temperature, top_p, top_k, min_p, "
    "repetition_penalty, max_new_tokens) of requests that don't set them come from: "
    "auto = the model folder's generation_config.json; vllm = ignore it and use neutral "
    "defaults (temperature 1, no top-p/top-k/min-p, no repetition penalty, generate up "
    "to the context length); PATH = the generation_config.json in folder PATH"
)

TRANSFORMERS = BuiltinEngine(
    name="transformers",
    target="penstock.engines.transformers:TransformersEngine",
    description="Serve a local Hugging Face causal-LM checkpoint with continuous batching.",
    loads_checkpoint=True,
    options=(
        EngineOption(
            "--model",
            "folder of a Hugging Face causal-LM checkpoint",
            type=Path,
            shown_default="the embedded SmolLM2-135M-Instruct, converted once into "
            "--model-cache-dir",
        ),
        _SERVED_MODEL_NAME,
        EngineOption("--device", "auto = cuda if present", default="auto", choices=DEVICES),
        _DTYPE,
        EngineOption("--max-num-seqs", "sequences decoded together", type=positive_int, default=16),
        EngineOption(
            "--max-model-len",
            "context length in tokens",
            type=positive_int,
            shown_default="the model's max_position_embeddings",
        ),
        EngineOption(
            "--kv-cache-tokens",
            "KV pool size in tokens across all sequences and cached prefixes, whose keys "
            "and values are allocated once at that size and used in place",
            type=positive_int,
            shown_default="max-num-seqs x max-model-len, at most a quarter of the device's memory",
            exclusive="kv-pool",
        ),
        EngineOption(
            "--kv-cache-bytes",
            "KV pool size in bytes of keys and values (instead of --kv-cache-tokens)",
            type=positive_int,
            aliases=("--kv-cache-memory-bytes",),
            exclusive="kv-pool",
        ),
        EngineOption(
            "--enable-prefix-caching",
            "reuse the KV of prompt blocks seen before",
            kind="negatable",
            default=True,
        ),
        EngineOption(
            "--max-num-batched-tokens",
            "tokens one step computes at most, decode rows and prefill chunks together; a "
            "longer prompt is prefilled over several steps",
            type=positive_int,
            default=2048,
        ),
        EngineOption(
            "--decode-gap-ratio",
            "on cpu, while rows decode, a step that also prefills part of a longer prompt "
            "aims at this many times the time of a step of the rows alone (measured as it "
            "runs): higher prefills the prompt sooner and spaces the decoding streams' "
            "tokens further apart",
            type=ratio_above_one,
            default=2.0,
        ),
        EngineOption(
            "--grammar-compile-timeout",
            "seconds an output constraint may take to compile before its request is a 400 "
            "naming this limit (each API key compiles one constraint at a time)",
            type=positive_seconds,
            default=10.0,
        ),
        EngineOption("--seed", "seed for requests without a seed", type=int, default=0),
        EngineOption(
            "--model-cache-dir",
            "where converted models live",
            type=Path,
            shown_default=f"${MODEL_CACHE_ENV} or ~/.cache/penstock/models",
        ),
        _CPU_THREADS,
        EngineOption(
            "--cpu-weight-dtype", _CPU_WEIGHT_DTYPE_HELP, default="auto", choices=CPU_WEIGHT_DTYPES
        ),
        EngineOption(
            "--cpu-activation-dtype",
            _CPU_ACTIVATION_DTYPE_HELP,
            default="float32",
            choices=CPU_ACTIVATION_DTYPES,
        ),
        EngineOption(
            "--generation-config",
            _GENERATION_CONFIG_HELP,
            default="auto",
            metavar="auto|vllm|PATH",
        ),
        EngineOption(
            "--encoder-cache-bytes",
            "bytes of image features a vision-language model keeps, so a repeated image "
            "skips the vision tower",
            type=positive_int,
            default=256 * 1024 * 1024,
            shown_default="268435456, 256 MiB",
        ),
        _HEALTH_CHECK_PAYLOAD,
        EngineOption(
            "--deterministic",
            "one sequence per forward pass, no prefix cache, float32 weights on cpu, and "
            "logprobs recomputed by one forward pass over prompt and completion: a request's "
            "output does not depend on what runs beside it, and its logprobs equal a "
            "trainer's forward pass (see penstock serve --deterministic)",
            kind="switch",
            default=False,
        ),
    ),
)

TRANSFORMERS_POOLING = BuiltinEngine(
    name="transformers-pooling",
    target="penstock.engines.transformers.pooling:TransformersPoolingEngine",
    description="Serve a local Hugging Face checkpoint for embeddings or classification.",
    loads_checkpoint=True,
    options=(
        EngineOption("--model", "checkpoint folder", type=Path, required=True),
        _SERVED_MODEL_NAME,
        EngineOption(
            "--task",
            "embed = /v1/embeddings; classify = /classify and /pooling (reward models); "
            "auto = classify for a *ForSequenceClassification checkpoint, else embed",
            default="auto",
            choices=POOLING_TASKS,
        ),
        EngineOption(
            "--pooling",
            "how embed pools token states: auto = the checkpoint's sentence-transformers "
            "config, else last token for *ForCausalLM checkpoints and the first token "
            "otherwise",
            default="auto",
            choices=POOLING_METHODS,
        ),
        EngineOption("--device", "auto = cuda if present", default="auto", choices=DEVICES),
        _DTYPE,
        EngineOption(
            "--max-model-len",
            "longest input in tokens",
            type=positive_int,
            shown_default="the model's max_position_embeddings",
        ),
        EngineOption(
            "--max-batch-tokens",
            "padded tokens in one forward pass",
            type=positive_int,
            default=16384,
        ),
        _CPU_THREADS,
    ),
)

SAMPLE = BuiltinEngine(
    name="sample",
    target="penstock.engines.samples.engine:SampleLLMEngine",
    description="Sample token engine: rotating token ids, no model weights.",
    options=(
        EngineOption("--model", "model name", default="sample-model", aliases=("--model-name",)),
        _SERVED_MODEL_NAME,
        EngineOption(
            "--tokenizer",
            "folder with tokenizer.json and a chat template",
            shown_default="the shipped one",
        ),
        EngineOption("--delay", "seconds before each token", type=float, default=0.01),
        EngineOption("--max-tokens", "tokens when none asked", type=int, default=16),
        EngineOption("--context-length", "context length in tokens", type=int, default=2048),
        EngineOption(
            "--token-budget",
            "advertise a TokenBudget of this many tokens (prompt + completion)",
            type=int,
        ),
        EngineOption("--endpoint-types", _ENDPOINT_TYPES_HELP, default="chat,completions"),
        _HEALTH_CHECK_PAYLOAD,
        EngineOption(
            "--image-input",
            "accept image parts and start each reply with the size of every image",
            kind="switch",
            default=False,
        ),
        EngineOption(
            "--audio-input",
            "accept audio parts and start each reply with the length of every clip",
            kind="switch",
            default=False,
        ),
    ),
)

SAMPLE_DIFFUSION = BuiltinEngine(
    name="sample-diffusion",
    target="penstock.engines.samples.diffusion:SampleDiffusionEngine",
    description="Sample image engine: 1x1 PNG answers, no model weights.",
    options=(
        EngineOption(
            "--model", "model name", default="sample-diffusion-model", aliases=("--model-name",)
        ),
        _SERVED_MODEL_NAME,
        EngineOption("--namespace", "Dynamo namespace of the worker", default="dynamo"),
        EngineOption("--component", "Dynamo component of the worker", default="sample"),
        EngineOption("--endpoint", "Dynamo endpoint of the worker", default="generate"),
        EngineOption("--delay", "seconds before each answer", type=float, default=0.05),
        EngineOption(
            "--steps", "simulated denoising steps reported as progress", type=int, default=0
        ),
        EngineOption("--endpoint-types", _ENDPOINT_TYPES_HELP, default="images"),
        _HEALTH_CHECK_PAYLOAD,
        EngineOption(
            "--input-reference",
            "take a reference image (input_reference) and answer with it",
            kind="switch",
            default=False,
        ),
    ),
)

DIFFUSION = BuiltinEngine(
    name="diffusion",
    target="penstock.engines.diffusion:DiffusersEngine",
    description="Video and image generation on a local diffusers pipeline.",
    loads_checkpoint=True,
    options=(
        EngineOption(
            "--model",
            "local diffusers pipeline folder",
            shown_default="a tiny random-weight Wan pipeline",
        ),
        EngineOption("--model-name", "name to serve", shown_default="the folder's name"),
        _SERVED_MODEL_NAME,
        EngineOption(
            "--endpoint-types",
            _ENDPOINT_TYPES_HELP,
            shown_default="videos,images for video pipelines, images for image pipelines",
        ),
        EngineOption("--device", "device to run on", shown_default="cuda when available, else cpu"),
        EngineOption(
            "--dtype",
            "weights' dtype; half = float16, float = float32",
            type=dtype_name,
            choices=DTYPES[1:],
            shown_default="the pipeline's",
        ),
        EngineOption("--seed", "weight seed of the tiny pipeline", type=int, default=0),
        EngineOption("--default-size", "video WxH when a request has none", metavar="WxH"),
        EngineOption("--default-image-size", "image WxH when a request has none", metavar="WxH"),
        EngineOption("--default-fps", "video frames per second when a request has none", type=int),
        EngineOption("--default-seconds", "video length when a request has none", type=int),
        EngineOption("--default-steps", "denoising steps when a request has none", type=int),
        EngineOption("--max-num-frames", "most video frames a request may ask", type=int),
        EngineOption("--max-sequence-length", "longest prompt in text-encoder tokens", type=int),
        _HEALTH_CHECK_PAYLOAD,
    ),
)

VLLM = BuiltinEngine(
    name="vllm",
    target="penstock.engines.vllm.engine:VllmEngine",
    description="Serve a local checkpoint on vLLM's AsyncLLM in the gateway's process.",
    loads_checkpoint=True,
    takes_other_options=True,
    options=(
        EngineOption(
            "--model",
            "folder of a checkpoint vLLM serves; every other vLLM engine argument "
            "(--max-model-len, --enforce-eager, --dtype, ...) is passed to vLLM as typed",
            shown_default="the embedded SmolLM2-135M-Instruct folder",
        ),
    ),
)

BUILTIN_ENGINES: dict[str, BuiltinEngine] = {
    engine.name: engine
    for engine in (TRANSFORMERS, TRANSFORMERS_POOLING, SAMPLE, SAMPLE_DIFFUSION, DIFFUSION, VLLM)
}

_NOT_IMPLEMENTED = "is a vLLM option Penstock does not implement"
# vLLM options a vLLM user types that no Penstock engine honours: (name, takes a value,
# what Penstock does instead). Refused rather than ignored, so nothing runs other than
# asked.
VLLM_ONLY_OPTIONS: tuple[tuple[str, bool, str], ...] = (
    ("--tensor-parallel-size", True, "one process serves one device"),
    ("-tp", True, "one process serves one device"),
    ("--pipeline-parallel-size", True, "one process serves one device"),
    ("-pp", True, "one process serves one device"),
    ("--data-parallel-size", True, "replicas run with --ray --ray-replicas N"),
    ("-dp", True, "replicas run with --ray --ray-replicas N"),
    (
        "--gpu-memory-utilization",
        True,
        "the transformers engine sizes its KV pool with --kv-cache-tokens or --kv-cache-bytes",
    ),
    ("--quantization", True, "see --cpu-weight-dtype for the weights' dtype on cpu"),
    ("-q", True, "see --cpu-weight-dtype for the weights' dtype on cpu"),
    ("--kv-cache-dtype", True, "the KV cache has the model's --dtype"),
    ("--block-size", True, "the KV block size is fixed"),
    ("--swap-space", True, "preempted sequences are recomputed"),
    ("--cpu-offload-gb", True, "weights stay on the device"),
    ("--enforce-eager", False, "the model always runs eagerly"),
    ("--trust-remote-code", False, "only architectures transformers ships are loaded"),
    ("--download-dir", True, "nothing is downloaded; hub ids come from the local cache"),
    ("--load-format", True, "safetensors and .bin checkpoints are read"),
    ("--revision", True, "a hub id is served from the snapshot its main ref points to"),
    ("--tokenizer-mode", True, "tokenizer.json is read with the tokenizers library"),
    ("--chat-template", True, "the checkpoint's own chat template is used"),
    ("--enable-lora", False, "adapters load at runtime: POST /v1/load_lora_adapter"),
    ("--lora-modules", True, "adapters load at runtime: POST /v1/load_lora_adapter"),
    ("--max-loras", True, "adapters load at runtime: POST /v1/load_lora_adapter"),
    (
        "--enable-auto-tool-choice",
        False,
        "tool_choice auto works whenever --tool-call-parser is set; drop it",
    ),
    ("--max-logprobs", True, "up to 20 top logprobs are returned"),
    ("--disable-log-stats", False, "see --no-access-log"),
    ("--enable-log-requests", False, "see --access-log"),
    ("--disable-log-requests", False, "see --no-access-log"),
    ("--uvicorn-log-level", True, "see --log-level"),
    ("--limit-mm-per-prompt", True, "see --media-max-images-per-request"),
    ("--speculative-config", True, "no speculative decoding"),
    ("--compilation-config", True, "the model always runs eagerly"),
    ("--distributed-executor-backend", True, "one process serves one device"),
    ("--ssl-keyfile", True, "serve TLS from a proxy in front"),
    ("--ssl-certfile", True, "serve TLS from a proxy in front"),
    ("--root-path", True, "serve a path prefix from a proxy in front"),
)


def vllm_only_options() -> list[tuple[str, bool, str]]:
    """:data:`VLLM_ONLY_OPTIONS` as refusals, each saying what Penstock does instead."""
    return [
        (name, takes_value, f"{_NOT_IMPLEMENTED} ({instead})")
        for name, takes_value, instead in VLLM_ONLY_OPTIONS
    ]
