// The AVX2 kernels that multiply by weights rebuilt from GGUF blocks, bit for bit: the
// records gguf_linear.h reads (weights/gguf_weights.py packs them), each weight rebuilt
// as `bfloat16(d * q + m)` (Q4_1) or `bfloat16(d * q)` (Q8_0) in registers, rounded to
// nearest even with integer steps (AVX2 has no bfloat16 conversion). A group of 4 rows
// of the weight is rebuilt once into float32, in column order, then multiplied by every
// row of x with the bfloat16 kernel's tiles and in its order of additions, so the
// results equal bf16_linear's on the rebuilt weight exactly.
#pragma once

#include <vector>

constexpr int64_t kQ41Record = 24, kQ80Record = 36;

// float32 to the nearest bfloat16 (ties to even), as float32: finite values only.
TILE_STEP __m256 round_to_bf16(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF0000)));
}

// A Q4_1 record's 32 weights into out[0..32), in column order. Byte 4i + j of the
// nibbles holds, low, column 8j + i and, high, column 8j + 4 + i (i, j < 4): the 16
// bytes read as 4 dwords, shifted by 8j (+ 4) bits, give 8 columns' levels, looked up
// among the 16 rebuilt weights (two registers of 8, the level's bit 3 picking one).
static inline void q4_1_rebuild(const uint8_t* record, float* out) {
  const float* dm = reinterpret_cast<const float*>(record);
  const __m256 d = _mm256_set1_ps(dm[0]), m = _mm256_set1_ps(dm[1]);
  // d * q is exact in float32, so the fused multiply-add rounds as numpy's d * q + m.
  const __m256 low = round_to_bf16(_mm256_fmadd_ps(d, _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), m));
  const __m256 high =
      round_to_bf16(_mm256_fmadd_ps(d, _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), m));
  const __m256i nibbles =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 8)));
  for (int j = 0; j < 4; ++j) {
    const int s = 8 * j;
    const __m256i shifts = _mm256_setr_epi32(s, s, s, s, s + 4, s + 4, s + 4, s + 4);
    const __m256i level =
        _mm256_and_si256(_mm256_srlv_epi32(nibbles, shifts), _mm256_set1_epi32(15));
    const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(level, 28));
    _mm256_storeu_ps(out + s, _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, level),
                                               _mm256_permutevar8x32_ps(high, level), upper));
  }
}

// A Q8_0 record's 32 weights into out[0..32), in column order: of slots 0-15, the even
// ones are columns 0-7 and the odd ones 16-23; of slots 16-31, columns 8-15 and 24-31.
static inline void q8_0_rebuild(const uint8_t* record, float* out) {
  const __m256 d = _mm256_set1_ps(*reinterpret_cast<const float*>(record));
  for (int half = 0; half < 2; ++half) {
    const __m256i q = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 4 + 16 * half)));
    const __m256i even = _mm256_srai_epi32(_mm256_slli_epi32(q, 16), 16);
    const __m256i odd = _mm256_srai_epi32(q, 16);
    _mm256_storeu_ps(out + 8 * half, round_to_bf16(_mm256_mul_ps(_mm256_cvtepi32_ps(even), d)));
    _mm256_storeu_ps(out + 16 + 8 * half,
                     round_to_bf16(_mm256_mul_ps(_mm256_cvtepi32_ps(odd), d)));
  }
}

// As tile_bf16, for float32 weight rows w (NB of them, K apart).
template <int MB, int NB>
static inline void tile_f32(const float* x, const float* w, float* y, int64_t m0, int64_t n0,
                            int64_t K, int64_t N) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    accumulate(acc, wv, x, m0, k, K);
  }
  store(acc, y, m0, n0, N);
}

template <bool Q4>
static torch::Tensor block_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.is_contiguous());
  const int64_t record = Q4 ? kQ41Record : kQ80Record;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K / 32 * record);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  penstock::WorkShare::instance().run(N, penstock::column_grain(M, K), [&](int64_t begin, int64_t end) {
    std::vector<float> rows(4 * K);
    float* rp = rows.data();
    for (int64_t n0 = begin; n0 < end; n0 += 4) {
      const int64_t count = std::min<int64_t>(4, end - n0);
      for (int64_t j = 0; j < count; ++j)
        for (int64_t b = 0; b < K / 32; ++b) {
          const uint8_t* at = wp + (n0 + j) * (K / 32) * record + b * record;
          if (Q4) q4_1_rebuild(at, rp + j * K + b * 32);
          else q8_0_rebuild(at, rp + j * K + b * 32);
        }
      columns(
          M, 0, count,
          [&](int64_t m, int64_t n) { tile_f32<4, 2>(xp, rp + n * K, yp, m, n0 + n, K, N); },
          [&](int64_t m, int64_t n) { tile_f32<1, 4>(xp, rp + n * K, yp, m, n0 + n, K, N); },
          [&](int64_t m, int64_t n) { tile_f32<4, 1>(xp, rp + n * K, yp, m, n0 + n, K, N); },
          [&](int64_t m, int64_t n) { tile_f32<1, 1>(xp, rp + n * K, yp, m, n0 + n, K, N); });
    }
  });
  return y;
}

// y[M, N] = x[M, K] @ w^T, w[N, K / 32 * 24] Q4_1 records; K % 32 == 0.
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor w) { return block_linear<true>(x, w); }

// y[M, N] = x[M, K] @ w^T, w[N, K / 32 * 36] Q8_0 records; K % 32 == 0.
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor w) { return block_linear<false>(x, w); }
