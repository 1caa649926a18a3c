"""Linear layers that decode from the GGUF blocks their bfloat16 weights were converted from.

The default model is converted from a GGUF whose linear weights are Q4_1 and whose tied
embedding and output layer is Q8_0 (see ``kernels/gguf_linear.h``): its bfloat16
checkpoint is, weight for weight, those blocks rebuilt. The conversion keeps the blocks beside the
checkpoint (:data:`BLOCKS_FILE`, rows in the checkpoint's order: transformers reorders the
rows of the attention's q and k weights when it reads a GGUF); at start each layer's
blocks are rebuilt and compared with its bfloat16 weight bit for bit, and only layers
that match decode from them. A decode step then reads ~0.8 bytes a weight instead of 2
and computes what the bfloat16 path computes, up to the order of the additions.

Weight updates write the bfloat16 parameters, as before; ``requantize`` then compares
each layer again and a layer whose weight changed goes back to its bfloat16 weight for
good: never a stale block.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from penstock.engines.transformers.weights import cpu_weights
from penstock.engines.transformers.weights.cpu_weights import Bf16WeightLinear, DerivedWeightLinear

logger = logging.getLogger(__name__)

# safetensors inside, but not named *.safetensors: whatever reads a folder's checkpoint
# (transformers, weight updates from the folder) must not take the blocks for weights.
BLOCKS_FILE = "gguf_blocks.st"
# x [M, K] float32, records [N, K / 32 * record]: y [M, N] float32.
BlockLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BLOCK = 32
# Bytes of a GGUF block, and of the kernel's record of one (float32 scales).
_GGUF_BYTES = {"Q4_1": 20, "Q8_0": 34}
_RECORD_BYTES = {"Q4_1": 24, "Q8_0": 36}
# GGUF tensor names of a llama model and the checkpoint's.
_LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def checkpoint_name(gguf_name: str) -> str | None:
    """The checkpoint parameter a llama GGUF tensor becomes; None for others."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    found = _BLOCK_NAME.fullmatch(gguf_name)
    if found is None or found.group(2) not in _LLAMA_NAMES:
        return None
    return f"model.layers.{found.group(1)}.{_LLAMA_NAMES[found.group(2)]}.weight"


def _q4_1_slot_columns() -> torch.Tensor:
    """The block column of each nibble slot of a Q4_1 record (slot ``2 * byte + high``).

    The kernel reads word ``w`` of 32 from byte ``2 * (w % 8) + (w >= 16)``, the high
    nibble when ``w // 8`` is odd, and widens the even words into the block's first 16
    weights and the odd ones into the last 16 (see ``kernels/gguf_linear.h``).
    """
    columns = torch.empty(32, dtype=torch.long)
    for word in range(32):
        byte, high = 2 * (word % 8) + (word >= 16), (word // 8) % 2
        columns[2 * byte + high] = word // 2 + 16 * (word % 2)
    return columns


def _q8_0_slot_columns() -> torch.Tensor:
    """The block column of each int8 of a Q8_0 record: the kernel rounds slots 0-15 and
    16-31 into bfloat16 words 0-15 and 16-31, then widens them as for Q4_1."""
    columns = torch.empty(32, dtype=torch.long)
    for word in range(32):
        columns[word] = (word % 16) // 2 + 8 * (word >= 16) + 16 * (word % 2)
    return columns


_SLOT_COLUMNS = {"Q4_1": _q4_1_slot_columns(), "Q8_0": _q8_0_slot_columns()}


def records_from_gguf(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """The kernel's records ``[N, K / 32 * record]`` of GGUF blocks ``[N, K / 32 * bytes]``
    (Q4_1: float16 d and m, then byte j holds weight j low and j + 16 high; Q8_0: float16
    d then 32 int8): float32 scales, the weights in the kernel's slots."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _GGUF_BYTES[kind])
    head = 4 if kind == "Q4_1" else 2
    scales = blocks[..., :head].contiguous().view(torch.float16).float()
    rest = blocks[..., head:]
    if kind == "Q4_1":
        levels = torch.cat((rest & 15, rest >> 4), dim=-1)[..., _SLOT_COLUMNS[kind]]
        rest = levels[..., 0::2] | (levels[..., 1::2] << 4)
    else:
        rest = rest[..., _SLOT_COLUMNS[kind]]
    wide = scales.contiguous().view(torch.uint8)
    return torch.cat((wide, rest), dim=-1).reshape(rows, -1).contiguous()


def rebuild(records: torch.Tensor, kind: str) -> torch.Tensor:
    """The bfloat16 weights ``[N, K]`` records hold, rounded as the ``gguf`` package's
    float32 dequantization then ``.to(torch.bfloat16)`` round them (and the kernel does)."""
    rows = records.shape[0]
    blocks = records.reshape(rows, -1, _RECORD_BYTES[kind])
    in_slots = torch.empty(*blocks.shape[:2], 32, dtype=torch.float32)
    if kind == "Q4_1":
        scales = blocks[..., :8].contiguous().view(torch.float32)
        packed = blocks[..., 8:]
        in_slots[..., 0::2], in_slots[..., 1::2] = packed & 15, packed >> 4
        levels = torch.empty_like(in_slots)
        levels[..., _SLOT_COLUMNS[kind]] = in_slots
        # A product then a sum, each rounded to float32, as numpy computes d * q + m.
        weights = levels * scales[..., :1]
        weights = weights + scales[..., 1:]
    else:
        scale = blocks[..., :4].contiguous().view(torch.float32)
        in_slots.copy_(blocks[..., 4:].contiguous().view(torch.int8))
        levels = torch.empty_like(in_slots)
        levels[..., _SLOT_COLUMNS[kind]] = in_slots
        weights = levels * scale
    return weights.reshape(rows, -1).to(torch.bfloat16)


def _row_order(rebuilt: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``order`` with ``rebuilt[order]`` bitwise equal to ``weight``; None if there is none."""
    if torch.equal(rebuilt.view(torch.int16), weight.view(torch.int16)):
        return torch.arange(weight.shape[0])
    if rebuilt.shape != weight.shape:
        return None
    rows = {bytes(row): index for index, row in enumerate(rebuilt.view(torch.int16).numpy())}
    order = [rows.get(bytes(row)) for row in weight.view(torch.int16).numpy()]
    if any(index is None for index in order):
        return None
    return torch.tensor(order)


def write_blocks_file(gguf_path: Path, folder: Path) -> int:
    """Keep the GGUF blocks of the checkpoint in ``folder`` that rebuild its weights
    exactly, rows in the checkpoint's order, in ``folder / BLOCKS_FILE``; returns how
    many tensors that is (none: no file)."""
    from gguf import GGUFReader

    weights = load_file(str(folder / "model.safetensors"))
    kept: dict[str, torch.Tensor] = {}
    for tensor in GGUFReader(str(gguf_path)).tensors:
        kind = tensor.tensor_type.name
        name = checkpoint_name(tensor.name)
        if kind not in _GGUF_BYTES or name not in weights:
            continue
        raw = torch.from_numpy(np.array(tensor.data))
        order = _row_order(rebuild(records_from_gguf(raw, kind), kind), weights[name])
        if order is not None:
            kept[f"{name}.{kind}"] = raw[order].contiguous()
    if kept:
        partial = folder / f".{BLOCKS_FILE}.partial"
        save_file(kept, str(partial))
        partial.replace(folder / BLOCKS_FILE)
    return len(kept)


class GgufBlockLinear(DerivedWeightLinear):
    """A ``Bf16WeightLinear`` that multiplies by the GGUF blocks its weight was rebuilt from.

    ``gguf_records`` is None once the weight no longer equals them (see ``requantize``):
    the layer then computes from its bfloat16 weight, as the bfloat16 path does.
    """

    gguf_records: torch.Tensor | None
    gguf_kind: str

    def requantize(self) -> None:
        records = self.gguf_records
        if records is not None and not _rebuilds(records, self.gguf_kind, self.weight):
            self.gguf_records = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        records = self.gguf_records
        kernel = cpu_weights._kernel
        if records is not None and kernel is not None and x.is_cpu and x.dtype == torch.float32:
            flat = x.reshape(-1, x.shape[-1])
            if 0 < flat.shape[0] <= cpu_weights._KERNEL_MAX_ROWS and self.bias is None:
                out = self._block_linear()(flat.contiguous(), records)
                return out.view(*x.shape[:-1], out.shape[1])
        return super().forward(x)

    def _block_linear(self) -> BlockLinear:
        kernel = cpu_weights._kernel
        if self.bf16_activations:
            if self.gguf_kind == "Q4_1":
                return kernel.q4_1_linear_bf16_activations
            return kernel.q8_0_linear_bf16_activations
        return kernel.q4_1_linear if self.gguf_kind == "Q4_1" else kernel.q8_0_linear

    def row_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = self.weight
        block_linear = self._block_linear()
        bf16_linear = cpu_weights.bf16_weight_kernel(self.bf16_activations, weight.shape[1])

        def forward(x: torch.Tensor) -> torch.Tensor:
            # Read at each call: ``requantize`` may drop the blocks.
            records = self.gguf_records
            return bf16_linear(x, weight) if records is None else block_linear(x, records)

        return forward


def _rebuilds(records: torch.Tensor, kind: str, weight: torch.Tensor) -> bool:
    if weight.dtype != torch.bfloat16 or not weight.is_cpu:
        return False
    return torch.equal(rebuild(records, kind).view(torch.int16), weight.view(torch.int16))


def gguf_unavailable_reason(folder: Path) -> str | None:
    """Why layers can't decode from GGUF blocks here; None when they can."""
    kernel = cpu_weights._kernel
    if kernel is None:
        return "the CPU kernels are not loaded"
    if not cpu_weights.has_gguf_kernels():
        return "the CPU has no AVX512-BF16, which its AVX-512 GGUF kernels need"
    if not (folder / BLOCKS_FILE).is_file():
        return f"{folder} has no {BLOCKS_FILE} (a checkpoint converted from a GGUF has)"
    return None


def use_gguf_blocks(model: torch.nn.Module, folder: Path) -> str | None:
    """Let every bfloat16 linear layer of ``model`` whose weight the blocks in ``folder``
    rebuild bit for bit decode from them; returns why none can, or None."""
    reason = gguf_unavailable_reason(folder)
    if reason is not None:
        return reason
    stored = load_file(str(folder / BLOCKS_FILE))
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    used = differ = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, Bf16WeightLinear) or module.bias is not None:
                continue
            found = _stored_blocks(stored, names.get(id(module.weight), []))
            if found is None:
                continue
            kind, raw = found
            records = records_from_gguf(raw, kind)
            if not _rebuilds(records, kind, module.weight):
                differ += 1
                continue
            module.__class__ = GgufBlockLinear
            module.gguf_records, module.gguf_kind = records, kind
            used += 1
    logger.info(
        "%d linear layers decode from GGUF blocks, %d differ from their weights", used, differ
    )
    return None if used else f"no weight of the model equals the blocks in {folder}"


def decode_from_gguf_blocks(model: torch.nn.Module, folder: Path, choice: str) -> bool:
    """``use_gguf_blocks`` for ``--cpu-weight-dtype gguf``, or for ``auto`` resolved to
    ``bfloat16`` (``choice``): then only where ``folder`` has blocks and the CPU has
    AVX512-BF16. Returns whether layers decode from them; why not is logged."""
    if choice != "gguf" and not (folder / BLOCKS_FILE).is_file():
        return False
    if choice != "gguf" and not cpu_weights.has_avx512_bf16():
        # The AVX2 kernels rebuild the blocks at about the bfloat16 kernel's speed at one
        # row and slower at 16 (bench/README.md, cpu_kernels.py): bfloat16 stays the default.
        return False
    failure = use_gguf_blocks(model, folder)
    if failure is not None:
        # Asked for, a warning; chosen by auto, where bfloat16 is the plan B, a note.
        level = logging.WARNING if choice == "gguf" else logging.INFO
        asked = "gguf" if choice == "gguf" else "auto"
        logger.log(level, "weights stay bfloat16 (--cpu-weight-dtype %s): %s", asked, failure)
    return failure is None


def restore_gguf_blocks(model: torch.nn.Module, folder: Path) -> None:
    """``use_gguf_blocks`` for a model loaded again (after deep sleep); a model whose
    layers still hold their blocks (a LoRA adapter attached or detached) keeps them,
    without reading and comparing them all again."""
    if not any(isinstance(module, GgufBlockLinear) for module in model.modules()):
        use_gguf_blocks(model, folder)


def _stored_blocks(
    stored: dict[str, torch.Tensor], names: list[str]
) -> tuple[str, torch.Tensor] | None:
    for name in names:
        for kind in _GGUF_BYTES:
            if f"{name}.{kind}" in stored:
                return kind, stored[f"{name}.{kind}"]
    return None
