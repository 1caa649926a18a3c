"""Decode attention over the KV pool's blocks, read in place.

Each decode row has one query token; its keys and values are the slots its block table
names (:mod:`.kv_cache`), never copied into a padded batch. On the CPU a small C++
kernel (``paged_attention.cpp``), built at first use like :mod:`.cpu_weights`' kernels,
computes each row's attention per KV head (the query heads sharing it together) in two
passes over the row's slots: scores, then the softmax-weighted sum of values. It reads
each row's own tokens only, so rows of very different lengths cost what they hold, with
no mask.
Elsewhere (CUDA, or a CPU where the kernel cannot be built) :func:`gathered_attention`
copies the rows' slots into a padded batch and calls ``scaled_dot_product_attention``.

Both compute softmax in float32 with its maximum subtracted first, as
``scaled_dot_product_attention`` does; only the order of the additions differs.

The same library holds the rest of a lean decode step's work between its linear layers,
each a call where torch takes several ops (a step of SmolLM2-135M made ~1,000 calls of
10-20 us): :func:`rotary_decode_attention` rotates the step's queries and keys, writes
keys and values into the rows' slots and attends; :func:`rms_norm` and
:func:`add_rms_norm` are Llama's norm (``rms_norm.cpp``). Both give the bits torch's ops
give.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from penstock.engines.transformers.kernels.loader import (
    CompilerMissing,
    load_extension,
    report_missing_compiler,
)

logger = logging.getLogger(__name__)

_EXTENSION_NAME = "penstock_paged_attention"
_SOURCES = ["paged_attention.cpp", "rms_norm.cpp"]
# CPU seconds its build takes, for the first start's log line.
_BUILD_CPU_S = 50

_lock = threading.Lock()
_kernel: Any = None
_failure: str | None = None


def _flags() -> list[str]:
    # The build is cached by name and source: a cache shared with a CPU without AVX-512
    # must not load a build that uses it.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return ["-O3", "-mavx512f"]
    if capability == "AVX2":
        return ["-O3", "-mavx2", "-mfma"]
    return ["-O3"]


def load_attention_kernel(cache_dir: Path) -> str | None:
    """Build or load the CPU kernel; returns why it is unavailable, or None when ready."""
    global _kernel, _failure
    with _lock:
        if _kernel is not None or _failure is not None:
            return _failure
        flags = _flags()
        isa = {"-mavx512f": "_avx512", "-mavx2": "_avx2"}
        name = _EXTENSION_NAME + "".join(isa.get(flag, "") for flag in flags)
        try:
            kernel = load_extension(name, _SOURCES, flags, cache_dir, build_cpu_s=_BUILD_CPU_S)
        except CompilerMissing as exc:
            _failure = f"the paged attention kernel could not be built: {exc}"
            report_missing_compiler(exc)
            return _failure
        except Exception as exc:
            _failure = f"the paged attention kernel could not be built: {exc}"
            logger.warning(
                "%s; decode attention copies each row's KV into a padded batch instead "
                "(same results, slower as contexts grow)",
                _failure,
            )
            return _failure
        _kernel = kernel
        return None


def kernel_ready() -> bool:
    return _kernel is not None


def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """Each row's attention over its own slots: ``query`` ``[rows, heads, dim]``;
    ``keys``/``values`` one layer's slots ``[slots, kv heads, dim]``; ``table`` each row's
    block ids ``[rows, blocks]`` (int32); ``lengths`` its tokens (int32, this step's
    included). Returns ``[rows, heads, dim]``. Needs :func:`load_attention_kernel`."""
    assert _kernel is not None
    return _kernel.paged_decode_attention(query, keys, values, table, lengths, scale, block_size)


def rotary_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: tuple[torch.Tensor, torch.Tensor, int],
    slots: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """A decode step's attention from its linear layers' outputs (``query`` ``[rows,
    heads * dim]``, ``key``/``value`` ``[rows, kv heads * dim]``): queries and keys
    rotated by ``cos``/``sin`` (``[rows, dim]``, ``sin``'s first half negated), each row's
    key and value written into its slot (``slots``, int64) of the ``pool``'s layer (keys
    and values ``[layers, slots, kv heads, dim]``, the layer's index), then
    :func:`paged_attention`. Returns ``[rows, heads * dim]``."""
    assert _kernel is not None
    keys, values, layer = pool
    return _kernel.rotary_decode_attention(
        query, key, value, cos, sin, keys, values, layer, slots, table, lengths, scale, block_size
    )


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` of float32 rows ``[rows, width]`` (float32 weight)."""
    assert _kernel is not None
    return _kernel.rms_norm(hidden, weight, eps)


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``hidden += delta`` (in place), then :func:`rms_norm` of it."""
    assert _kernel is not None
    return _kernel.add_rms_norm(hidden, delta, weight, eps)


def gathered_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_table: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The same attention from the rows' slots copied into a padded batch: ``slot_table``
    ``[rows, columns]`` (right-aligned, padding at a slot of zeros), ``mask`` ``[rows, 1,
    1, columns]`` or None when no row is padded. Returns ``[rows, heads, dim]``."""
    rows, heads, dim = query.shape
    kv_heads = keys.shape[1]
    gathered_keys = keys[slot_table].transpose(1, 2)
    gathered_values = values[slot_table].transpose(1, 2)
    packed = query.view(rows, kv_heads, heads // kv_heads, dim)
    attended = F.scaled_dot_product_attention(
        packed, gathered_keys, gathered_values, attn_mask=mask, scale=scale
    )
    return attended.reshape(rows, heads, dim)
