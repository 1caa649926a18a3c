"""The linear layers of one SmolLM2-135M decode step, on each weight-only CPU kernel.

Every linear weight of the default model (30 layers of q, k, v, o, gate, up, down, and the
tied output layer), each variant built from the real bfloat16 weights, called in model
order with 1 and 16 rows at one thread: float32 weights (MKL), the hand kernels of
``cpu_weights`` (bfloat16, int8 with one scale per 64 weights), the lossless GGUF-block
kernels of ``gguf_weights`` (Q4_1 linears, Q8_0 output layer), both hand kernels also with
bfloat16 activations (``--cpu-activation-dtype bfloat16``: x rounded, ``vdpbf16ps``;
lossy; one row stays float32) and torch's own
(``_weight_int8pack_mm``, one scale per row; ``_weight_int4pack_mm_for_cpu``, groups of
32 and 64; float32 activations, and bfloat16 ones for two of them). Prints the step's
median and fastest of 7 passes, and the median per layer kind.

    .venv/bin/python bench/cpu_kernels.py [--variants "hand bf16,torch int8 channel"]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import load_file

from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import DEFAULT_MODEL_NAME
from penstock.engines.transformers.weights import cpu_weights, gguf_weights

Kernel = Callable[[torch.Tensor], torch.Tensor]
VARIANTS = (
    "torch float32",
    "hand bf16",
    "hand gguf",
    "hand bf16 (bf16 activations)",
    "hand gguf (bf16 activations)",
    "hand int8 g64",
    "torch int8 channel",
    "torch int4 g32",
    "torch int4 g64",
    "torch int8 channel (bf16 x)",
    "torch int4 g32 (bf16 x)",
)
_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int8_per_row_kernel(weight: torch.Tensor) -> Kernel:
    """Symmetric int8 with one scale per output row, the layout torch's int8 kernel reads."""
    wide = weight.float()
    scales = (wide.abs().amax(dim=1) / 127).clamp_min(1e-12)
    quantized = (wide / scales[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, quantized, scales.to(x.dtype))


def int4_kernel(weight: torch.Tensor, group: int) -> Kernel:
    """torch's int4 layout: levels 0..15 per group, read as (q - 8) * scale + zero."""
    rows, width = weight.shape
    groups = weight.float().reshape(rows, width // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp_min(1e-12)
    levels = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        levels.to(torch.int32).reshape(rows, width), 1
    )
    scales_and_zeros = torch.stack((scales, low + 8 * scales), -1).transpose(0, 1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, packed, group, scales_and_zeros.to(x.dtype)
    )


def gguf_kernel(name: str, blocks: dict[str, torch.Tensor], bf16_activations: bool) -> Kernel:
    """The GGUF blocks the bfloat16 weight was rebuilt from (``--cpu-weight-dtype gguf``)."""
    name = "model.embed_tokens.weight" if name == "lm_head" else name
    kind = "Q4_1" if f"{name}.Q4_1" in blocks else "Q8_0"
    records = gguf_weights.records_from_gguf(blocks[f"{name}.{kind}"], kind)
    # The AVX2 kernels have no bfloat16-activation variants: looked up only when asked for.
    suffix = "_bf16_activations" if bf16_activations else ""
    call = getattr(cpu_weights._kernel, f"{kind.lower()}_linear{suffix}")
    return lambda x: call(x, records)


def kernel(variant: str, weight: torch.Tensor) -> Kernel:
    if variant.endswith(" (bf16 x)"):
        # torch's kernels are fast only for bfloat16 activations (rounded: not lossless).
        inner = kernel(variant.removesuffix(" (bf16 x)"), weight)
        return lambda x: inner(x.bfloat16()).float()
    hand = cpu_weights._kernel
    if variant == "torch float32":
        wide = weight.float()
        return lambda x: torch.nn.functional.linear(x, wide)
    if variant.startswith("hand bf16"):
        bf16 = weight.contiguous()
        call = cpu_weights.bf16_weight_kernel(
            variant.endswith("(bf16 activations)"), weight.shape[1]
        )
        return lambda x: call(x, bf16)
    if variant == "hand int8 g64":
        quantized, scales = cpu_weights.quantize_int8(weight)
        return lambda x: hand.int8_linear(x, quantized, scales)
    if variant == "torch int8 channel":
        return int8_per_row_kernel(weight)
    return int4_kernel(weight, int(variant.rsplit("g", 1)[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    failure = cpu_weights.load_kernel(default_model_cache_dir())
    if failure is not None:
        print(f"the hand kernels are unavailable: {failure}")
        return 1
    state = load_file(str(default_model_cache_dir() / DEFAULT_MODEL_NAME / "model.safetensors"))
    weights = [(n, w) for n, w in state.items() if w.dim() == 2 and "embed" not in n]
    weights.append(("lm_head", state["model.embed_tokens.weight"]))
    folder = default_model_cache_dir() / DEFAULT_MODEL_NAME
    blocks_path = folder / gguf_weights.BLOCKS_FILE
    blocks = load_file(str(blocks_path)) if blocks_path.is_file() else {}
    for variant in args.variants.split(","):
        from_blocks = variant.startswith("hand gguf")
        if from_blocks and not blocks:
            print(f"{variant}: no {blocks_path} (the engine writes it at start)")
            continue
        layers = [
            (
                next((k for k in _KINDS if k in name), "lm_head"),
                gguf_kernel(name, blocks, variant.endswith("(bf16 activations)"))
                if from_blocks
                else kernel(variant, w),
                w.shape[1],
            )
            for name, w in weights
        ]
        for rows in (1, 16):
            inputs = {width: torch.randn(rows, width) for width in (576, 1536)}
            for _, call, width in layers:
                call(inputs[width])
            per_kind: dict[str, list[float]] = collections.defaultdict(list)
            steps = []
            for _ in range(7):
                spent: collections.Counter[str] = collections.Counter()
                started = time.perf_counter()
                for kind, call, width in layers:
                    begun = time.perf_counter()
                    call(inputs[width])
                    spent[kind] += time.perf_counter() - begun
                steps.append(time.perf_counter() - started)
                for kind, seconds in spent.items():
                    per_kind[kind].append(seconds)
            kinds = " ".join(f"{k}={statistics.median(v) * 1e3:.2f}" for k, v in per_kind.items())
            print(
                f"{variant:<28} rows {rows:2}: step {statistics.median(steps) * 1e3:8.2f} ms "
                f"(fastest {min(steps) * 1e3:8.2f}) | {kinds}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
