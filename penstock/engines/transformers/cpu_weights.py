"""bfloat16 weights with float32 arithmetic on the CPU: half the bytes a decode step reads.

Decoding one token reads every weight once, so on the CPU a small model's step time is
memory traffic. A checkpoint stored in bfloat16 loses nothing when its weights stay in
bfloat16: widening bfloat16 to float32 is exact (a 16-bit shift), so a kernel that widens
each weight in registers and multiplies in float32 computes what the float32 model
computes, up to the order of the additions, while reading half the bytes. PyTorch has
no such kernel (its bfloat16 matmul also rounds the activations to bfloat16), so a small
AVX-512 one is compiled on first use with ``torch.utils.cpp_extension`` into the model
cache folder (~40 s once, then loaded from disk). Where it can't be built or run, weights
stay float32.

``pack_model`` turns the model's ``nn.Linear`` and ``nn.Embedding`` modules into the
subclasses below in place: parameter names and objects stay, only their storage becomes
bfloat16, so a weight update that copies into the parameters (``copy_``) keeps working
and there is nothing derived to refresh. Activations, norms, attention and logits stay
float32.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Rows beyond this go through one float32 matmul on a widened copy of the weight: for
# long prefills that is compute bound, where MKL's blocking beats the kernel's.
_KERNEL_MAX_ROWS = 64
_EXTENSION_NAME = "penstock_bf16_linear_v2"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline __m512 widen(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// MB rows of x against NB rows of w: MB*NB independent accumulators keep the FMA
// pipeline full, and each widened weight vector is used MB times.
template <int MB, int NB>
static inline void tile(const float* x, const uint16_t* w, float* y, int64_t m0, int64_t n0,
                        int64_t K, int64_t N) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = widen(w + (n0 + j) * K + k);
    // The next tiles' rows, 2 KB ahead of this one: 15-20% faster than the hardware
    // prefetcher alone here. Prefetches past the end of w are harmless hints.
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + NB) * K + k * NB) + 2048;
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    for (int i = 0; i < MB; ++i) {
      __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int NB>
static inline void columns(const float* x, const uint16_t* w, float* y, int64_t M, int64_t n0,
                           int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, NB>(x, w, y, m, n0, K, N);
  for (; m < M; ++m) tile<1, NB>(x, w, y, m, n0, K, N);
}

// y[M, N] = x[M, K] (float32) @ w[N, K]^T (bfloat16), accumulated in float32; K % 16 == 0.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 16 == 0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) columns<4>(xp, wp, yp, M, n, K, N);
    for (; n < end; ++n) columns<1>(xp, wp, yp, M, n, K, N);
  });
  return y;
}
"""

_lock = threading.Lock()
_kernel: Any = None
_failure: str | None = None


def _build(build_dir: Path) -> Any:
    from torch.utils.cpp_extension import load_inline

    build_dir.mkdir(parents=True, exist_ok=True)
    return load_inline(
        _EXTENSION_NAME,
        cpp_sources=_SOURCE,
        functions=["bf16_linear"],
        extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq"],
        build_directory=str(build_dir),
        verbose=False,
    )


def load_kernel(cache_dir: Path) -> str | None:
    """Build or load the kernel; returns why it is unavailable, or None when it is ready."""
    global _kernel, _failure
    with _lock:
        if _kernel is not None or _failure is not None:
            return _failure
        if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            _failure = "the CPU has no AVX-512"
            return _failure
        try:
            kernel = _build(cache_dir / "torch_extensions" / _EXTENSION_NAME)
            probe_x = torch.randn(3, 32)
            probe_w = torch.randn(5, 32).bfloat16()
            expected = F.linear(probe_x, probe_w.float())
            if not torch.allclose(kernel.bf16_linear(probe_x, probe_w), expected, atol=1e-5):
                raise RuntimeError("the kernel's result differs from torch's")
        except Exception as exc:
            _failure = f"the bfloat16 kernel could not be built: {exc}"
            return _failure
        _kernel = kernel
        return None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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
        out = _kernel.bf16_linear(x.reshape(rows, x.shape[-1]).contiguous(), weight)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


class Bf16WeightLinear(torch.nn.Linear):
    """``nn.Linear`` whose weight is stored in bfloat16 and multiplied in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias)


class Bf16WeightEmbedding(torch.nn.Embedding):
    """``nn.Embedding`` (often tied to the output layer) whose rows come out float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).float()


def pack_model(model: torch.nn.Module) -> int:
    """Store the float32 weights of every linear and embedding layer in bfloat16, in place.

    Idempotent; needs ``load_kernel`` to have succeeded. Returns how many layers changed.
    """
    if _kernel is None:
        raise RuntimeError("pack_model needs the kernel: call load_kernel first")
    packed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            # LoRA adapters keep their own dtype: they are small and read as they came.
            if "lora_" in name:
                continue
            if type(module) is torch.nn.Linear:
                module.__class__ = Bf16WeightLinear
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
    return packed
