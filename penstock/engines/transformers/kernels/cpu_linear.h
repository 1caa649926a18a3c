// bfloat16 and int8 weights with float32 arithmetic on the CPU (see
// weights/cpu_weights.py): the tiles and helpers that the GGUF and bfloat16-dot kernels
// build on.
#pragma once

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
