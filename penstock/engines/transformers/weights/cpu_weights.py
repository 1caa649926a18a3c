"""bfloat16 weights with float32 arithmetic on the CPU: half the bytes a decode step reads.

Decoding one token reads every weight once, so on the CPU a small model's step time is
memory traffic. A checkpoint stored in bfloat16 loses nothing when its weights stay in
bfloat16: widening bfloat16 to float32 is exact (a 16-bit shift), so a kernel that widens
each weight in registers and multiplies in float32 computes what the float32 model
computes, up to the order of the additions, while reading half the bytes. PyTorch has
no such kernel (its bfloat16 matmul also rounds the activations to bfloat16), so a small
one is compiled on first use by ``kernels/loader`` into the model cache folder (a CPU
minute or two once, then loaded from disk): AVX-512 (``kernels/cpu_linear.h``), else
AVX2 + FMA (``kernels/cpu_linear_avx2.cpp``: bfloat16 and int8 only). Where none can be
built or run, weights stay float32.

``pack_model`` turns the model's ``nn.Linear`` and ``nn.Embedding`` modules into the
subclasses below in place: parameter names and objects stay, only their storage becomes
bfloat16, so a weight update that copies into the parameters (``copy_``) keeps working
and there is nothing derived to refresh. Activations, norms, attention and logits stay
float32 (``--cpu-activation-dtype bfloat16`` rounds the linear layers' inputs: lossy, see
``kernels/bf16_dot.h``).

``--cpu-weight-dtype int8`` adds, on top, an int8 copy of each linear weight (symmetric,
one float32 scale per 64 weights of a row) that a second kernel of the same shape reads:
about half the bytes of bfloat16 again, for a documented loss of precision (see
``bench/README.md``). The copy is derived, so ``requantize`` must follow a weight update.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from penstock.engines.transformers.kernels.loader import (
    CompilerMissing,
    compiler_missing_reported,
    load_extension,
    report_missing_compiler,
)

logger = logging.getLogger(__name__)

# Rows beyond this go through one float32 matmul on a widened copy of the weight: for
# long prefills that is compute bound, where MKL's blocking beats the kernel's.
_KERNEL_MAX_ROWS = 64
# Per instruction set: the extension's name, sources, flags and the CPU seconds its build
# takes (for the first start's log line). AVX-512: the bfloat16 and int8 kernels, then the
# GGUF and bfloat16-dot ones built on them; AVX2: the bfloat16, int8 and GGUF kernels.
_EXTENSIONS = {
    "AVX512": (
        "penstock_cpu_linear",
        ["cpu_linear.cpp"],
        ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq"],
        90,
    ),
    "AVX2": ("penstock_cpu_linear_avx2", ["cpu_linear_avx2.cpp"], ["-O3", "-mavx2", "-mfma"], 60),
}
# Weights per int8 scale: 99.2% teacher-forced top-1 agreement with float32 on SmolLM2
# (per-channel scales: 96.9%, groups of 32: 98.0%).
INT8_GROUP = 64

_lock = threading.Lock()
_kernel: Any = None
_kernel_isa: str | None = None
_failure: str | None = None


def load_kernel(cache_dir: Path) -> str | None:
    """Build or load the kernel; returns why it is unavailable, or None when it is ready."""
    global _kernel, _kernel_isa, _failure
    with _lock:
        if _kernel is not None or _failure is not None:
            return _failure
        capability = torch.backends.cpu.get_cpu_capability()
        isa = "AVX512" if capability.startswith("AVX512") else capability
        extension = _EXTENSIONS.get(isa)
        if extension is None:
            _failure = f"the CPU has neither AVX-512 nor AVX2 (torch: {capability})"
            return _failure
        name, sources, flags, build_cpu_s = extension
        try:
            kernel = load_extension(name, sources, flags, cache_dir, build_cpu_s=build_cpu_s)
            probe_x = torch.randn(3, 32)
            probe_w = torch.randn(5, 32).bfloat16()
            expected = F.linear(probe_x, probe_w.float())
            if not torch.allclose(kernel.bf16_linear(probe_x, probe_w), expected, atol=1e-5):
                raise RuntimeError("the kernel's result differs from torch's")
            quantized, scales = quantize_int8(torch.randn(5, 128))
            expected = F.linear(probe_x.repeat(1, 4), dequantize_int8(quantized, scales))
            got = kernel.int8_linear(probe_x.repeat(1, 4), quantized, scales)
            if not torch.allclose(got, expected, atol=1e-5):
                raise RuntimeError("the int8 kernel's result differs from torch's")
        except Exception as exc:
            if isinstance(exc, CompilerMissing):
                report_missing_compiler(exc)
            _failure = f"the bfloat16 kernel could not be built: {exc}"
            return _failure
        _kernel, _kernel_isa = kernel, isa
        return None


def kernel_for_weights(cache_dir: Path) -> bool:
    """``load_kernel`` for the weights the engine asked for; when it fails, says that they
    stay float32: a warning, unless the one warning of a missing compiler said so."""
    failure = load_kernel(cache_dir)
    if failure is not None:
        level = logging.INFO if compiler_missing_reported() else logging.WARNING
        logger.log(level, "weights stay float32 (--cpu-weight-dtype): %s", failure)
    return failure is None


def has_avx512_bf16() -> bool:
    """Whether the loaded kernels can run AVX512-BF16 instructions (``vdpbf16ps``)."""
    return _kernel is not None and bool(_kernel.cpu_has_avx512_bf16())


def has_gguf_kernels() -> bool:
    """Whether the loaded kernels multiply by GGUF blocks: the AVX2 ones do; the AVX-512
    ones round to bfloat16 with an AVX512-BF16 instruction, so only where it runs."""
    return _kernel is not None and (_kernel_isa == "AVX2" or has_avx512_bf16())


def bf16_weight_kernel(bf16_activations: bool, width: int) -> Callable[..., torch.Tensor]:
    """The kernel for bfloat16 weights ``width`` wide: with ``bf16_activations`` the one
    that rounds x to bfloat16 (see ``kernels/bf16_dot.h``), where the width allows it."""
    if bf16_activations and width % 32 == 0:
        return _kernel.bf16_linear_bf16_activations
    return _kernel.bf16_linear


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bf16_activations: bool
) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (
        _kernel is not None
        and x.dtype == torch.float32
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and x.shape[-1] % 16 == 0
        and 0 < rows <= _KERNEL_MAX_ROWS
    ):
        kernel = bf16_weight_kernel(bf16_activations, x.shape[-1])
        out = kernel(x.reshape(rows, x.shape[-1]).contiguous(), weight)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


class Bf16WeightLinear(torch.nn.Linear):
    """``nn.Linear`` whose weight is stored in bfloat16 and multiplied in float32.

    With ``bf16_activations`` (``--cpu-activation-dtype bfloat16``), kernel calls of more
    than one row round x to bfloat16 first: lossy, see ``kernels/bf16_dot.h``.
    """

    bf16_activations = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias, self.bf16_activations)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of a ``[N, K]`` weight (K % 64 == 0): one float32 scale per 64 weights."""
    rows, width = weight.shape
    groups = weight.detach().float().reshape(rows, width // INT8_GROUP, INT8_GROUP)
    scales = (groups.abs().amax(dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    quantized = torch.round(groups / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return quantized.reshape(rows, width).contiguous(), scales.contiguous()


def dequantize_int8(quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, width = quantized.shape
    # int8 times float32 widens in the same pass: no float32 copy of the int8 weights first.
    groups = quantized.reshape(rows, width // INT8_GROUP, INT8_GROUP)
    return (groups * scales.unsqueeze(-1)).reshape(rows, width)


class DerivedWeightLinear(Bf16WeightLinear, abc.ABC):
    """A ``Bf16WeightLinear`` that decodes from a copy derived from its weight.

    ``requantize`` must follow every change of the weight; ``row_forward`` is the fast
    path ``row_linear`` hands the decode step, or None for the general one.
    """

    @abc.abstractmethod
    def requantize(self) -> None:
        """Derive the copy from the weight as it is now."""

    def row_forward(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None


class Int8WeightLinear(DerivedWeightLinear):
    """A ``Bf16WeightLinear`` that multiplies by an int8 copy of its weight (see ``requantize``).

    The bfloat16 parameter stays what weight updates, checksums and reads see; the int8
    copy with its scales is what the forward pass reads, half the bytes again.
    """

    int8_weight: torch.Tensor
    int8_scales: torch.Tensor
    # Set by ``requantize``: a decode step makes ~200 of these calls at one row, where
    # the checks of the general path cost several times the kernel's own ~2 us.
    _on_kernel = False

    def requantize(self) -> None:
        self.int8_weight, self.int8_scales = quantize_int8(self.weight)
        self._on_kernel = _kernel is not None and self.int8_weight.is_cpu and self.bias is None

    def row_forward(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not self._on_kernel:
            return None
        int8_linear = _kernel.int8_linear
        # Read at each call: ``requantize`` replaces the int8 copy.
        return lambda x: int8_linear(x, self.int8_weight, self.int8_scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._on_kernel and x.is_cpu and x.dtype == torch.float32:
            width = x.shape[-1]
            flat = x.reshape(-1, width)
            if 0 < flat.shape[0] <= _KERNEL_MAX_ROWS:
                out = _kernel.int8_linear(flat.contiguous(), self.int8_weight, self.int8_scales)
                return out.view(*x.shape[:-1], out.shape[1])
        return self._general(x)

    def _general(self, x: torch.Tensor) -> torch.Tensor:
        quantized, scales = self.int8_weight, self.int8_scales
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (
            _kernel is not None
            and x.dtype == torch.float32
            and x.is_cpu
            and quantized.is_cpu
            and 0 < rows <= _KERNEL_MAX_ROWS
        ):
            out = _kernel.int8_linear(x.reshape(rows, x.shape[-1]).contiguous(), quantized, scales)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.reshape(*x.shape[:-1], quantized.shape[0])
        # Long prefills (and any other device) compute with the same int8 weights, so
        # a prompt's length does not change which model answers it.
        weight = dequantize_int8(quantized, scales).to(device=x.device, dtype=x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))


def row_linear(module: torch.nn.Module, max_rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward for 2-D contiguous inputs of at most ``max_rows`` rows.

    A decode step calls ~200 linear layers at a few rows, where the general path's checks
    cost as much as the kernel; for inputs of that kind they hold once and for all. The
    kernel itself still checks dtypes and shapes. Anything else gets ``module.forward``.
    """
    if _kernel is None or max_rows > _KERNEL_MAX_ROWS or module.bias is not None:
        return module.forward
    if isinstance(module, DerivedWeightLinear):
        return module.row_forward() or module.forward
    weight = module.weight
    if _on_bf16_kernel(module):
        kernel = bf16_weight_kernel(module.bf16_activations, weight.shape[1])
        # The Parameter object outlives weight updates (they copy into it).
        return lambda x: kernel(x, weight)
    return module.forward


def _on_bf16_kernel(module: torch.nn.Module) -> bool:
    weight = module.weight
    return (
        type(module) is Bf16WeightLinear
        and weight.dtype == torch.bfloat16
        and weight.is_cpu
        and weight.is_contiguous()
        and weight.shape[1] % 16 == 0
    )


def row_linears(
    modules: Sequence[torch.nn.Module], max_rows: int
) -> Callable[[torch.Tensor], Sequence[torch.Tensor]]:
    """:func:`row_linear` of layers that read the same input, as one function: one kernel
    call for them all where they multiply by bfloat16 weights with float32 activations
    (``bf16_linears``: the same sums as one call each), else a call each."""
    singles = [row_linear(module, max_rows) for module in modules]
    grouped = getattr(_kernel, "bf16_linears", None)
    if (
        grouped is None
        or max_rows > _KERNEL_MAX_ROWS
        or not all(
            _on_bf16_kernel(m) and not m.bf16_activations and m.bias is None for m in modules
        )
    ):
        return lambda x: [single(x) for single in singles]
    weights = [module.weight for module in modules]
    return lambda x: grouped(x, weights)


class Bf16WeightEmbedding(torch.nn.Embedding):
    """``nn.Embedding`` (often tied to the output layer) whose rows come out float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).float()


def pack_model(model: torch.nn.Module, *, int8: bool = False, activations: str = "float32") -> int:
    """Store the float32 weights of every linear and embedding layer in bfloat16, in place.

    With ``int8``, linear layers whose input width is a multiple of 64 also get an int8
    copy of their weight that their forward pass reads (embeddings stay bfloat16: a lookup
    reads one row). ``activations`` ``"bfloat16"`` (``--cpu-activation-dtype``) sets the
    layers' ``bf16_activations`` where the CPU has AVX512-BF16 (int8 layers ignore it);
    elsewhere it logs why not. Idempotent; needs ``load_kernel`` to have succeeded.
    Returns how many layers changed.
    """
    if _kernel is None:
        raise RuntimeError("pack_model needs the kernel: call load_kernel first")
    bf16_activations = activations == "bfloat16"
    if bf16_activations and not has_avx512_bf16():
        reason = "the CPU has no AVX512-BF16"
        logger.warning("activations stay float32 (--cpu-activation-dtype bfloat16): %s", reason)
        bf16_activations = False
    packed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            # LoRA adapters keep their own dtype: they are small and read as they came.
            if "lora_" in name:
                continue
            # A layer packed before may still lack its int8 copy.
            if type(module) in (torch.nn.Linear, Bf16WeightLinear):
                module.__class__ = Bf16WeightLinear
                module.bf16_activations = bf16_activations
                # Other widths would widen the whole weight every call: slower than float32.
                if module.in_features % 16:
                    continue
            elif type(module) is torch.nn.Embedding:
                module.__class__ = Bf16WeightEmbedding
            else:
                continue
            weight = module.weight
            if weight.dtype == torch.float32 and weight.device.type == "cpu":
                # Assigning .data keeps the Parameter object, so tied layers stay tied.
                weight.data = weight.data.to(torch.bfloat16).contiguous()
                packed += 1
            if int8 and type(module) is Bf16WeightLinear and module.in_features % INT8_GROUP == 0:
                module.__class__ = Int8WeightLinear
                module.requantize()  # type: ignore[attr-defined]
    return packed


def requantize(model: torch.nn.Module) -> int:
    """Refresh the copies derived from the weights (after a weight update); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, DerivedWeightLinear)]
    with torch.no_grad():
        for layer in layers:
            layer.requantize()
    return len(layers)
