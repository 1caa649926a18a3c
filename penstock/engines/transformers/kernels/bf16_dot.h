// The AVX512-BF16 kernels that round activations to bfloat16 (`--cpu-activation-dtype`).
//
// Lossy, and only on request: each row of x is rounded to bfloat16 once per call, as a GPU
// running the model in bfloat16 rounds it, and multiplied with `vdpbf16ps` (32 products
// an instruction, twice float32's FMA). Weights are exactly the ones the float32-activation
// kernels use: bfloat16 weights as stored, GGUF blocks rebuilt as gguf_linear.h does.
// A product of two bfloat16 is exact in float32 and the sums are float32, so the rounding
// of x is the only loss (besides the order of the additions; `vdpbf16ps` also counts
// subnormal inputs and sums as zero). Greedy tokens may differ from the float32 model's
// and `generate`'s, and, since a single row stays float32 (below), a request's tokens may
// depend on how many rows decode beside it (a prompt's prefill, several rows, is rounded).
// The default, `float32`, uses none of this.
//
// `vdpbf16ps` multiplies the two bfloat16 of each 32-bit lane pairwise: a bfloat16 weight
// row pairs neighbours `(w[k], w[k + 1])`, a rebuilt GGUF block of 32 pairs its weights
// `i` and `16 + i` (`q4_1_words`), so x is packed the same way before the products.
// A single row stays float32 (the float32-activation kernels): there rebuilding the weights,
// not multiplying, bounds the time, and bfloat16 gained nothing (GGUF blocks: 0.93-1.07x per
// layer of the default model, against 1.7-1.8x at 16 rows), so decode steps at concurrency 1
// stay exact.
// Rows of w are taken 4 at a time (rebuilt once into a buffer that stays in L1 for GGUF
// blocks) while every row of x passes over them, as `widened_row_passes` does.
//
// Needs AVX512-BF16; the Python side checks the CPU before calling. Built on the helpers of
// gguf_linear.h and cpu_linear.h.
#pragma once

#include "gguf_linear.h"

// x[M, K] rounded to bfloat16, two to a 32-bit word: (x[k], x[k + 1]) for bfloat16
// weights, or (x[b + i], x[b + 16 + i]) in each block of 32 from b for rebuilt blocks.
__attribute__((target("avx512bf16"))) static std::vector<uint32_t> pack_activations(
    const float* x, int64_t M, int64_t K, bool block_pairs) {
  std::vector<uint32_t> packed(M * K / 2);
  for (int64_t at = 0; at < M * K; at += 32) {
    const __m512 first = _mm512_loadu_ps(x + at), second = _mm512_loadu_ps(x + at + 16);
    __m512i words;
    if (block_pairs) {
      const __m512i low = _mm512_cvtepu16_epi32(
          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(first)));
      const __m512i high = _mm512_cvtepu16_epi32(
          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(second)));
      words = _mm512_or_si512(low, _mm512_slli_epi32(high, 16));
    } else {
      words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));
    }
    _mm512_storeu_si512(packed.data() + at / 2, words);
  }
  return packed;
}

// Rows [m0, m0 + MB) of packed x against NB rows of packed w, `pairs` words from the
// given starts (x's rows `x_stride` words apart, w's `w_stride`); sums go into y, or
// onto it with accumulate.
template <int MB, int NB>
__attribute__((target("avx512bf16"))) static inline void tile_dot(
    const uint32_t* x, int64_t x_stride, const uint32_t* w, int64_t w_stride, float* y,
    int64_t N, int64_t pairs, bool accumulate) {
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t p = 0; p < pairs; p += 16) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
      wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * w_stride + p));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + i * x_stride + p));
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    float* out = y + i * N;
    if constexpr (NB == 4) {
      const __m128 sums = reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      _mm_storeu_ps(out, accumulate ? _mm_add_ps(_mm_loadu_ps(out), sums) : sums);
    } else {
      for (int j = 0; j < NB; ++j)
        out[j] = (accumulate ? out[j] : 0.0f) + _mm512_reduce_add_ps(acc[i][j]);
    }
  }
}

// Rows [m0, m1) of x: tiles of 6 rows (24 accumulators, 4 weight vectors and x's
// vector: 29 of the 32 registers), then one for the rest.
template <int NB>
static inline void rows_dot(const uint32_t* x, int64_t x_stride, const uint32_t* w,
                            int64_t w_stride, float* y, int64_t N, int64_t m0, int64_t m1,
                            int64_t pairs, bool accumulate) {
  int64_t m = m0;
  const auto tile = [&](auto rows) {
    tile_dot<decltype(rows)::value, NB>(x + m * x_stride, x_stride, w, w_stride, y + m * N, N,
                                        pairs, accumulate);
  };
  for (; m + 6 <= m1; m += 6) tile(std::integral_constant<int, 6>());
  switch (m1 - m) {
    case 5: tile(std::integral_constant<int, 5>()); break;
    case 4: tile(std::integral_constant<int, 4>()); break;
    case 3: tile(std::integral_constant<int, 3>()); break;
    case 2: tile(std::integral_constant<int, 2>()); break;
    case 1: tile(std::integral_constant<int, 1>()); break;
  }
}

// Columns [begin, end) of y: x taken 64 rows at a time and at most 640 columns at a time,
// so that its packed rows stay in L1 with the 4 rows of w. `words(n, count, k0, k1,
// stride)` points at rows n..n+count-1 of w as packed words from column k0 to k1, their
// rows `stride` words apart.
template <typename Words>
static inline void dot_passes(const uint32_t* x, float* y, int64_t M, int64_t begin,
                              int64_t end, int64_t K, int64_t N, Words words) {
  constexpr int64_t kRowBlock = 64, kMaxDepth = 640;
  const int64_t passes = (K + kMaxDepth - 1) / kMaxDepth;
  const int64_t depth = (K / 32 + passes - 1) / passes * 32;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const int64_t k1 = std::min(K, k0 + depth), pairs = (k1 - k0) / 2;
      int64_t stride = 0;
      int64_t n = begin;
      for (; n + 4 <= end; n += 4) {
        const uint32_t* w = words(n, 4, k0, k1, stride);
        rows_dot<4>(x + k0 / 2, K / 2, w, stride, y + n, N, m0, m1, pairs, k0 > 0);
      }
      for (; n < end; ++n) {
        const uint32_t* w = words(n, 1, k0, k1, stride);
        rows_dot<1>(x + k0 / 2, K / 2, w, stride, y + n, N, m0, m1, pairs, k0 > 0);
      }
    }
  }
}

// Columns [k0, k1) of rows n0..n0+count-1 rebuilt as bfloat16 words into out.
template <bool Q4>
__attribute__((target("avx512bf16"))) static void rebuild_words(
    const uint8_t* w, uint32_t* out, int64_t n0, int count, int64_t k0, int64_t k1, int64_t K) {
  const int64_t record = Q4 ? kQ41Record : kQ80Record, row_bytes = K / 32 * record;
  const int64_t pairs = (k1 - k0) / 2;
  for (int j = 0; j < count; ++j)
    for (int64_t k = k0; k < k1; k += 32) {
      const uint8_t* at = w + (n0 + j) * row_bytes + k / 32 * record;
      // The same block of the next 4 rows: see dequantize_rows.
      _mm_prefetch(reinterpret_cast<const char*>(at + 4 * row_bytes), _MM_HINT_T0);
      _mm512_storeu_si512(out + j * pairs + (k - k0) / 2, Q4 ? q4_1_words(at) : q8_0_words(at));
    }
}

static void check_bf16_dot(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "the CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && x.size(1) % 32 == 0);
}

// y[M, N] = x[M, K] @ w[N, K]^T (bfloat16), x rounded to bfloat16 when M > 1, accumulated
// in float32; K % 32 == 0.
torch::Tensor bf16_linear_bf16_activations(torch::Tensor x, torch::Tensor w) {
  check_bf16_dot(x, w);
  if (x.size(0) == 1) return bf16_linear(x, w);
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.size(1) == x.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const std::vector<uint32_t> packed = pack_activations(x.data_ptr<float>(), M, K, false);
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> rows(4 * std::min<int64_t>(K, 640) / 2);
    dot_passes(packed.data(), yp, M, begin, end, K, N,
               [&](int64_t n, int count, int64_t k0, int64_t k1, int64_t& stride) {
                 // Copied into L1, the next rows prefetched, as blocks are rebuilt: read
                 // in place (with or without prefetches) the 16-row step took 45-48 ms
                 // against 42.8. Still bound by reading 2 bytes a weight.
                 stride = (k1 - k0) / 2;
                 for (int j = 0; j < count; ++j)
                   for (int64_t k = k0; k < k1; k += 32) {
                     const uint32_t* at = wp + (n + j) * K / 2 + k / 2;
                     _mm_prefetch(reinterpret_cast<const char*>(at + 4 * K / 2), _MM_HINT_T0);
                     _mm512_storeu_si512(rows.data() + j * stride + (k - k0) / 2,
                                         _mm512_loadu_si512(at));
                   }
                 return static_cast<const uint32_t*>(rows.data());
               });
  });
  return y;
}

template <bool Q4>
static torch::Tensor block_linear_bf16_activations(torch::Tensor x, torch::Tensor w) {
  check_bf16_dot(x, w);
  if (x.size(0) == 1) return block_linear<Q4>(x, w);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t record = Q4 ? kQ41Record : kQ80Record;
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.size(1) == K / 32 * record);
  auto y = torch::empty({M, N}, x.options());
  const std::vector<uint32_t> packed = pack_activations(x.data_ptr<float>(), M, K, true);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> rows(4 * std::min<int64_t>(K, 640) / 2);
    dot_passes(packed.data(), yp, M, begin, end, K, N,
               [&](int64_t n, int count, int64_t k0, int64_t k1, int64_t& stride) {
                 rebuild_words<Q4>(wp, rows.data(), n, count, k0, k1, K);
                 stride = (k1 - k0) / 2;
                 return static_cast<const uint32_t*>(rows.data());
               });
  });
  return y;
}

// As q4_1_linear, x rounded to bfloat16 when M > 1.
torch::Tensor q4_1_linear_bf16_activations(torch::Tensor x, torch::Tensor w) {
  return block_linear_bf16_activations<true>(x, w);
}

// As q8_0_linear, x rounded to bfloat16 when M > 1.
torch::Tensor q8_0_linear_bf16_activations(torch::Tensor x, torch::Tensor w) {
  return block_linear_bf16_activations<false>(x, w);
}
