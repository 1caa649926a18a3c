// The AVX-512 kernels that multiply by weights rebuilt from GGUF blocks, bit for bit.
//
// A checkpoint converted from a GGUF (the default model is) holds, in bfloat16, exactly
// `bfloat16(d * q + m)` (Q4_1: 4-bit `q`, float16 `d` and `m` per 32 weights) or
// `bfloat16(d * q)` (Q8_0: int8 `q`, float16 `d`): float32 products and sums, rounded
// to nearest even, as the `gguf` package computes them. These kernels read the blocks
// (0.75 and 1.125 bytes a weight against bfloat16's 2) and rebuild each weight the same
// way in registers, then multiply in float32 like the bfloat16 kernel. Only the order of
// the additions differs from the bfloat16 path, as between any two matmuls.
//
// Q4_1 records, one per block of a row: `d`, `m` (float32), then 16 bytes of 4-bit
// `q` in the order `q4_1_block` reads them; Q8_0 records: `d` (float32) then 32 int8
// in the order `q8_0_block` reads them (weights/gguf_weights.py packs both).
//
// The functions need AVX512-BF16 (`vcvtneps2bf16` rounds to bfloat16 in one
// instruction); the Python side checks the CPU before calling them. Built on the helpers
// of cpu_linear.h.
#pragma once

#include "cpu_linear.h"

#define BF16_STEP static inline __attribute__((always_inline, target("avx512bf16")))

constexpr int64_t kQ41Record = 24, kQ80Record = 36;

bool cpu_has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

// 32 bfloat16 weights (words) as float32: the even words, then the odd ones. The packing
// puts the block's first 16 weights in the even words and the last 16 in the odd ones.
BF16_STEP void widen_words(__m512i words, __m512& low, __m512& high) {
  low = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  high = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(0xFFFF0000)));
}

// The block's 16 possible weights, rounded to bfloat16 and stored twice (words 0-15 and
// 16-31), are looked up with vpermw, which reads the low 5 bits of each word: the 5th
// bit, a neighbour's, then picks the same value. The 16 bytes of nibbles, repeated in the
// four 128-bit lanes and shifted right by 0, 4, 8 and 12 bits lane by lane, put a
// different nibble in the low 4 bits of each of the 32 words.
BF16_STEP __m512i q4_1_words(const uint8_t* record) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 0x40004, 0x40004, 0x40004, 0x40004,
                                           0x80008, 0x80008, 0x80008, 0x80008, 0xC000C,
                                           0xC000C, 0xC000C, 0xC000C);
  const float* dm = reinterpret_cast<const float*>(record);
  // d * q is exact in float32 (11 by 4 significant bits), so the fused multiply-add
  // rounds once where numpy's product and sum round twice to the same value.
  const __m512 values = _mm512_fmadd_ps(_mm512_set1_ps(dm[0]), levels, _mm512_set1_ps(dm[1]));
  const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(values, values));
  const __m512i nibbles = _mm512_broadcast_i32x4(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 8)));
  return _mm512_permutexvar_epi16(_mm512_srlv_epi16(nibbles, shifts), table);
}

// Slots 0-15 and 16-31 rounded into words 0-15 and 16-31: gguf_weights orders the slots
// so that the even words again hold the block's first 16 weights.
BF16_STEP __m512i q8_0_words(const uint8_t* record) {
  const __m512 d = _mm512_set1_ps(*reinterpret_cast<const float*>(record));
  const __m128i* q = reinterpret_cast<const __m128i*>(record + 4);
  const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
  const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
  return reinterpret_cast<__m512i>(
      _mm512_cvtne2ps_pbh(_mm512_mul_ps(second, d), _mm512_mul_ps(first, d)));
}

BF16_STEP void q4_1_block(const uint8_t* record, __m512& low, __m512& high) {
  widen_words(q4_1_words(record), low, high);
}

BF16_STEP void q8_0_block(const uint8_t* record, __m512& low, __m512& high) {
  widen_words(q8_0_words(record), low, high);
}

// MB rows of x against NB rows of blocks: each block is rebuilt once and used MB times.
template <int MB, int NB, bool Q4>
__attribute__((target("avx512bf16"))) static inline void block_tile(
    const float* x, const uint8_t* w, float* y, int64_t m0, int64_t n0, int64_t K, int64_t N) {
  const int64_t blocks = K / 32, record = Q4 ? kQ41Record : kQ80Record;
  const int64_t row_bytes = blocks * record;
  __m512 acc[MB][NB];
  zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 low[NB], high[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* at = w + (n0 + j) * row_bytes + b * record;
      if (Q4) q4_1_block(at, low[j], high[j]);
      else q8_0_block(at, low[j], high[j]);
    }
    // The next tiles' rows, 2 KB ahead, as the bfloat16 kernel does.
    const char* ahead =
        reinterpret_cast<const char*>(w + (n0 + NB) * row_bytes + b * record * NB) + 2048;
    for (int64_t line = 0; line < record * NB; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    accumulate(acc, low, x, m0, b * 32, K);
    accumulate(acc, high, x, m0, b * 32 + 16, K);
  }
  store(acc, y, m0, n0, N);
}

template <int NB, bool Q4>
__attribute__((target("avx512bf16"))) static void block_columns(
    const float* x, const uint8_t* w, float* y, int64_t M, int64_t n0, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) block_tile<8, NB, Q4>(x, w, y, m, n0, K, N);
  for (; m + 4 <= M; m += 4) block_tile<4, NB, Q4>(x, w, y, m, n0, K, N);
  for (; m < M; ++m) block_tile<1, NB, Q4>(x, w, y, m, n0, K, N);
}

// Columns [k0, k1) of rows n0..n0+3 rebuilt into float32 rows of out (as dequantize_rows).
template <bool Q4>
__attribute__((target("avx512bf16"))) static void rebuild_rows(
    const uint8_t* w, float* out, int64_t n0, int64_t k0, int64_t k1, int64_t K) {
  const int64_t record = Q4 ? kQ41Record : kQ80Record, row_bytes = K / 32 * record;
  const int64_t depth = k1 - k0;
  for (int j = 0; j < 4; ++j)
    for (int64_t k = k0; k < k1; k += 32) {
      const uint8_t* at = w + (n0 + j) * row_bytes + k / 32 * record;
      // The same block of the next 4 rows: see dequantize_rows.
      _mm_prefetch(reinterpret_cast<const char*>(at + 4 * row_bytes), _MM_HINT_T0);
      __m512 low, high;
      if (Q4) q4_1_block(at, low, high);
      else q8_0_block(at, low, high);
      _mm512_storeu_ps(out + j * depth + k - k0, low);
      _mm512_storeu_ps(out + j * depth + k - k0 + 16, high);
    }
}

// Beyond 8 rows a tile would rebuild each block again for every 8 rows of x: as for
// int8, 4 rows of w are rebuilt once into float32 (widened_row_passes).
template <bool Q4>
__attribute__((target("avx512bf16"))) static void block_columns_rebuilt(
    const float* x, const uint8_t* w, float* y, int64_t M, int64_t begin, int64_t end,
    int64_t K, int64_t N) {
  widened_row_passes(
      x, y, M, begin, end, K, N, 32,
      [&](float* rows, int64_t n, int64_t k0, int64_t k1) {
        rebuild_rows<Q4>(w, rows, n, k0, k1, K);
      },
      [&](int64_t m0, int64_t m1, int64_t n) {
        block_columns<1, Q4>(x + m0 * K, w, y + m0 * N, m1 - m0, n, K, N);
      });
}

template <bool Q4>
static torch::Tensor block_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "the CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 32 * (Q4 ? kQ41Record : kQ80Record));
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    if (M > 8) {
      block_columns_rebuilt<Q4>(xp, wp, yp, M, begin, end, K, N);
      return;
    }
    int64_t n = begin;
    if (M <= 4)
      for (; n + 4 <= end; n += 4) block_columns<4, Q4>(xp, wp, yp, M, n, K, N);
    else
      for (; n + 2 <= end; n += 2) block_columns<2, Q4>(xp, wp, yp, M, n, K, N);
    for (; n < end; ++n) block_columns<1, Q4>(xp, wp, yp, M, n, K, N);
  });
  return y;
}

// y[M, N] = x[M, K] @ w^T, w[N, K / 32 * 24] Q4_1 records; K % 32 == 0.
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor w) { return block_linear<true>(x, w); }

// y[M, N] = x[M, K] @ w^T, w[N, K / 32 * 36] Q8_0 records; K % 32 == 0.
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor w) { return block_linear<false>(x, w); }
