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
float32 (``--cpu-activation-dtype bfloat16`` rounds the linear layers' inputs: lossy, see
:mod:`.bf16_dot_kernel`).

``--cpu-weight-dtype int8`` adds, on top, an int8 copy of each linear weight (symmetric,
one float32 scale per 64 weights of a row) that a second kernel of the same shape reads:
about half the bytes of bfloat16 again, for a documented loss of precision (see
``bench/README.md``). The copy is derived, so ``requantize`` must follow a weight update.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from penstock.engines.transformers.kernels.bf16_dot_kernel import (
    BF16_DOT_FUNCTIONS,
    BF16_DOT_SOURCE,
)
from penstock.engines.transformers.kernels.gguf_kernel import GGUF_FUNCTIONS, GGUF_SOURCE

logger = logging.getLogger(__name__)

# Rows beyond this go through one float32 matmul on a widened copy of the weight: for
# long prefills that is compute bound, where MKL's blocking beats the kernel's.
_KERNEL_MAX_ROWS = 64
_EXTENSION_NAME = "penstock_cpu_linear_v15"
# Weights per int8 scale: 99.2% teacher-forced top-1 agreement with float32 on SmolLM2
# (per-channel scales: 96.9%, groups of 32: 98.0%).
INT8_GROUP = 64

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

static inline __m512 widen(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The tiles' shared steps, inlined so the accumulators stay in registers.
#define TILE_STEP static inline __attribute__((always_inline))

template <int MB, int NB>
TILE_STEP void zero(__m512 (&acc)[MB][NB]) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
}

// acc[i][j] += 16 floats of row m0 + i of x, from column k, times wv[j].
template <int MB, int NB>
TILE_STEP void accumulate(__m512 (&acc)[MB][NB], const __m512 (&wv)[NB], const float* x,
                          int64_t m0, int64_t k, int64_t K) {
  for (int i = 0; i < MB; ++i) {
    __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
  }
}

template <int MB, int NB>
TILE_STEP void store(__m512 (&acc)[MB][NB], float* y, int64_t m0, int64_t n0, int64_t N) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// MB rows of x against NB rows of w: MB*NB independent accumulators keep the FMA
// pipeline full, and each widened weight vector is used MB times.
template <int MB, int NB>
static inline void tile(const float* x, const uint16_t* w, float* y, int64_t m0, int64_t n0,
                        int64_t K, int64_t N) {
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = widen(w + (n0 + j) * K + k);
    // The next tiles' rows, 2 KB ahead of this one: 15-20% faster than the hardware
    // prefetcher alone here. Prefetches past the end of w are harmless hints.
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + NB) * K + k * NB) + 2048;
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    accumulate(acc, wv, x, m0, k, K);
  }
  store(acc, y, m0, n0, N);
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

static inline __m512 widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// As tile, for int8 weights with one float32 scale per 64 weights of a row. Widening int8
// costs a third more than bfloat16, so tiles are 8 rows of x by 2 of w (16 accumulators):
// at 8-16 rows 20% faster than 4 by 4, and no slower at one.
template <int MB, int NB>
static inline void tile_i8(const float* x, const int8_t* w, const float* s, float* y, int64_t m0,
                           int64_t n0, int64_t K, int64_t N) {
  const int64_t G = K / 64;
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    __m512 sv[NB];
    for (int j = 0; j < NB; ++j) sv[j] = _mm512_set1_ps(s[(n0 + j) * G + g]);
    // The next tiles' rows, 2 KB ahead, one line per row-group read: 2.3x the bfloat16
    // kernel at one row (512 B and 1 KB ahead, or into L2 only, were no faster).
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + NB) * K + g * 64 * NB) + 2048;
    for (int j = 0; j < NB; ++j) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
    for (int kk = 0; kk < 64; kk += 16) {
      const int64_t k = g * 64 + kk;
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_mul_ps(widen_i8(w + (n0 + j) * K + k), sv[j]);
      accumulate(acc, wv, x, m0, k, K);
    }
  }
  store(acc, y, m0, n0, N);
}

template <int NB>
static inline void columns_i8(const float* x, const int8_t* w, const float* s, float* y,
                              int64_t M, int64_t n0, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tile_i8<8, NB>(x, w, s, y, m, n0, K, N);
  for (; m + 4 <= M; m += 4) tile_i8<4, NB>(x, w, s, y, m, n0, K, N);
  for (; m < M; ++m) tile_i8<1, NB>(x, w, s, y, m, n0, K, N);
}

// Columns [k0, k1) of rows n0..n0+NB-1 of w times their scales, as float32 rows of out
// (out[j * (k1 - k0) + k - k0]); k0 and k1 are multiples of 64.
template <int NB>
static inline void dequantize_rows(const int8_t* w, const float* s, float* out, int64_t n0,
                                   int64_t k0, int64_t k1, int64_t K) {
  const int64_t G = K / 64, depth = k1 - k0;
  for (int j = 0; j < NB; ++j)
    for (int64_t g = k0 / 64; g < k1 / 64; ++g) {
      // The same line of the next NB rows, read after this group's multiplications: weights
      // come from memory at each step, and the hardware prefetcher alone left the 16-row
      // step as slow as tile_i8's. Prefetches past the end of w are harmless hints.
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + NB + j) * K + g * 64), _MM_HINT_T0);
      const __m512 sv = _mm512_set1_ps(s[(n0 + j) * G + g]);
      for (int kk = 0; kk < 64; kk += 16) {
        const int64_t k = g * 64 + kk;
        _mm512_storeu_ps(out + j * depth + k - k0,
                         _mm512_mul_ps(widen_i8(w + (n0 + j) * K + k), sv));
      }
    }
}

// The lane sums of a, b, c and d, in that order: 13 instructions where four
// _mm512_reduce_add_ps take ~32.
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m512 halves = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4E));
  const __m512 quarters = _mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, 0xB1));
  return _mm512_castps512_ps128(quarters);
}

// Columns [k0, k1) of MB rows of x against 4 dequantized rows of w (w[j * (k1 - k0) + k - k0],
// in L1); the sums go into y, or onto it with accumulate.
template <int MB>
static inline void tile_f32x4(const float* x, const float* w, float* y, int64_t m0, int64_t n0,
                              int64_t k0, int64_t k1, int64_t K, int64_t N, bool accumulate) {
  const int64_t depth = k1 - k0;
  __m512 acc[MB][4];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; k += 16) {
    __m512 wv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(w + j * depth + k);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k0 + k);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    float* out = y + (m0 + i) * N + n0;
    const __m128 sums = reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    _mm_storeu_ps(out, accumulate ? _mm_add_ps(_mm_loadu_ps(out), sums) : sums);
  }
}

// Rows [m0, m1) of x against 4 dequantized rows of w: tiles of 6 rows (24 accumulators,
// 4 weight vectors and x's vector: 29 of the 32 registers), then one for the rest.
static inline void rows_f32x4(const float* x, const float* w, float* y, int64_t m0, int64_t m1,
                              int64_t n0, int64_t k0, int64_t k1, int64_t K, int64_t N,
                              bool accumulate) {
  int64_t m = m0;
  for (; m + 6 <= m1; m += 6) tile_f32x4<6>(x, w, y, m, n0, k0, k1, K, N, accumulate);
  switch (m1 - m) {
    case 5: tile_f32x4<5>(x, w, y, m, n0, k0, k1, K, N, accumulate); break;
    case 4: tile_f32x4<4>(x, w, y, m, n0, k0, k1, K, N, accumulate); break;
    case 3: tile_f32x4<3>(x, w, y, m, n0, k0, k1, K, N, accumulate); break;
    case 2: tile_f32x4<2>(x, w, y, m, n0, k0, k1, K, N, accumulate); break;
    case 1: tile_f32x4<1>(x, w, y, m, n0, k0, k1, K, N, accumulate); break;
  }
}

// Beyond 8 rows a tile widens each weight again for every 8 rows (int8 at 16 rows: ~110
// GFLOP/s). Here 4 rows of w are widened once into float32 that stay in L1 while every
// row of x passes over them: SmolLM2's linears at 16 rows 38 -> 29 ms. x is taken 64 rows
// at a time, and at most 640 columns at a time (16 rows of 576 columns fit in L1), the
// later passes adding onto y. `widen(rows, n, k0, k1)` writes rows n..n+3 of w, columns
// k0..k1, as float32; `single(m0, m1, n)` computes one leftover row n of w for x's rows
// m0..m1; `group` is the weights' block width, which a pass's depth keeps whole.
template <typename Widen, typename Single>
static inline void widened_row_passes(const float* x, float* y, int64_t M, int64_t begin,
                                      int64_t end, int64_t K, int64_t N, int64_t group,
                                      Widen widen, Single single) {
  constexpr int64_t kRowBlock = 64, kMaxDepth = 640;
  const int64_t passes = (K + kMaxDepth - 1) / kMaxDepth;
  const int64_t depth = (K / group + passes - 1) / passes * group;
  std::vector<float> rows(4 * depth);
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const int64_t k1 = std::min(K, k0 + depth);
      for (int64_t n = begin; n + 4 <= end; n += 4) {
        widen(rows.data(), n, k0, k1);
        rows_f32x4(x, rows.data(), y, m0, m1, n, k0, k1, K, N, k0 > 0);
      }
    }
    for (int64_t n = begin + (end - begin) / 4 * 4; n < end; ++n) single(m0, m1, n);
  }
}

static void columns_i8_dequantized(const float* x, const int8_t* w, const float* s, float* y,
                                   int64_t M, int64_t begin, int64_t end, int64_t K,
                                   int64_t N) {
  widened_row_passes(
      x, y, M, begin, end, K, N, 64,
      [&](float* rows, int64_t n, int64_t k0, int64_t k1) {
        dequantize_rows<4>(w, s, rows, n, k0, k1, K);
      },
      [&](int64_t m0, int64_t m1, int64_t n) {
        columns_i8<1>(x + m0 * K, w, s, y + m0 * N, m1 - m0, n, K, N);
      });
}

// y[M, N] = x[M, K] @ (w[N, K] * s[N, K / 64] per group of 64)^T in float32; K % 64 == 0.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor s) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar && w.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 64 == 0);
  TORCH_CHECK(s.scalar_type() == torch::kFloat && s.is_contiguous() && s.numel() == N * (K / 64));
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    if (M > 8) {
      columns_i8_dequantized(xp, wp, sp, yp, M, begin, end, K, N);
      return;
    }
    int64_t n = begin;
    for (; n + 2 <= end; n += 2) columns_i8<2>(xp, wp, sp, yp, M, n, K, N);
    for (; n < end; ++n) columns_i8<1>(xp, wp, sp, yp, M, n, K, N);
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
        cpp_sources=_SOURCE + GGUF_SOURCE + BF16_DOT_SOURCE,
        functions=["bf16_linear", "int8_linear", *GGUF_FUNCTIONS, *BF16_DOT_FUNCTIONS],
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
            quantized, scales = quantize_int8(torch.randn(5, 128))
            expected = F.linear(probe_x.repeat(1, 4), dequantize_int8(quantized, scales))
            got = kernel.int8_linear(probe_x.repeat(1, 4), quantized, scales)
            if not torch.allclose(got, expected, atol=1e-5):
                raise RuntimeError("the int8 kernel's result differs from torch's")
        except Exception as exc:
            _failure = f"the bfloat16 kernel could not be built: {exc}"
            return _failure
        _kernel = kernel
        return None


def has_avx512_bf16() -> bool:
    """Whether the loaded kernels can run AVX512-BF16 instructions (``vdpbf16ps``)."""
    return _kernel is not None and bool(_kernel.cpu_has_avx512_bf16())


def bf16_weight_kernel(bf16_activations: bool, width: int) -> Callable[..., torch.Tensor]:
    """The kernel for bfloat16 weights ``width`` wide: with ``bf16_activations`` the one
    that rounds x to bfloat16 (see :mod:`.bf16_dot_kernel`), where the width allows it."""
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
    than one row round x to bfloat16 first: lossy, see :mod:`.bf16_dot_kernel`.
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
    if (
        type(module) is Bf16WeightLinear
        and weight.dtype == torch.bfloat16
        and weight.is_cpu
        and weight.is_contiguous()
        and weight.shape[1] % 16 == 0
    ):
        kernel = bf16_weight_kernel(module.bf16_activations, weight.shape[1])
        # The Parameter object outlives weight updates (they copy into it).
        return lambda x: kernel(x, weight)
    return module.forward


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
