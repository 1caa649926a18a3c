// The CPU linear kernels for AVX2 + FMA CPUs (no AVX-512), with the AVX-512 extension's
// interface (cpu_linear.cpp): bfloat16 weights widened exactly to float32 in registers (a
// 16-bit shift), int8 weights times their group's scale, GGUF blocks rebuilt exactly
// (gguf_linear_avx2.h), float32 multiply-adds. Eight floats a register and 16 registers,
// so the tiles are smaller than cpu_linear.h's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

#include "work_share.h"

#define TILE_STEP static inline __attribute__((always_inline))

TILE_STEP __m256 widen8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TILE_STEP __m256 widen8_i8(const int8_t* p) {
  __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

TILE_STEP float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[i][j] += 8 floats of row m0 + i of x, from column k, times wv[j].
template <int MB, int NB>
TILE_STEP void accumulate(__m256 (&acc)[MB][NB], const __m256 (&wv)[NB], const float* x,
                          int64_t m0, int64_t k, int64_t K) {
  for (int i = 0; i < MB; ++i) {
    __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
  }
}

template <int MB, int NB>
TILE_STEP void store(__m256 (&acc)[MB][NB], float* y, int64_t m0, int64_t n0, int64_t N) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[(m0 + i) * N + n0 + j] = sum8(acc[i][j]);
}

// MB rows of x against NB rows of w (bfloat16), MB * NB accumulators.
template <int MB, int NB>
static inline void tile_bf16(const float* x, const uint16_t* w, float* y, int64_t m0,
                             int64_t n0, int64_t K, int64_t N) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    // One weight row at a time is read as one sequential stream, with the next row's line
    // asked for a row ahead: one row of x against 4 rows of w at once read them as 4
    // interleaved streams, 1.4x slower from DRAM (270 MB a step: 15.3 -> 10.6 ms on 2 cores).
    if (MB == 1 && NB == 1 && k % 32 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + 1) * K + k), _MM_HINT_T0);
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = widen8(w + (n0 + j) * K + k);
    accumulate(acc, wv, x, m0, k, K);
  }
  store(acc, y, m0, n0, N);
}

// As tile_bf16, for int8 weights with one float32 scale per 64 weights of a row.
template <int MB, int NB>
static inline void tile_i8(const float* x, const int8_t* w, const float* s, float* y, int64_t m0,
                           int64_t n0, int64_t K, int64_t N) {
  const int64_t G = K / 64;
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 sv[NB];
    for (int j = 0; j < NB; ++j) sv[j] = _mm256_set1_ps(s[(n0 + j) * G + g]);
    for (int64_t k = g * 64; k < (g + 1) * 64; k += 8) {
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm256_mul_ps(widen8_i8(w + (n0 + j) * K + k), sv[j]);
      accumulate(acc, wv, x, m0, k, K);
    }
  }
  store(acc, y, m0, n0, N);
}

// Columns [begin, end) of y: 4 rows of x by 2 of w where there are 4 rows (8 accumulators),
// else one row by 4 of w, so a single row still has 4 independent FMA chains.
template <typename Tile4x2, typename Tile1x4, typename Tile4x1, typename Tile1x1>
static inline void columns(int64_t M, int64_t begin, int64_t end, Tile4x2 t42, Tile1x4 t14,
                           Tile4x1 t41, Tile1x1 t11) {
  int64_t n = begin;
  for (; n + 4 <= end; n += 4) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      t42(m, n);
      t42(m, n + 2);
    }
    for (; m < M; ++m) t14(m, n);
  }
  for (; n < end; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) t41(m, n);
    for (; m < M; ++m) t11(m, n);
  }
}

// As columns, for the bfloat16 tiles: from 4 rows up, 4 rows by 3 of w (12 accumulators,
// each widened weight used 4 times, each row of x 3 times: 1.5x faster than 4 by 2 at 16
// rows on AVX2), the rows left one by 3; under 4 rows, one row by one of w (the weights'
// read from memory, not the multiply-adds, is what takes the time there).
template <typename Tile4x3, typename Tile1x3, typename Tile1x1>
static inline void columns_by3(int64_t M, int64_t begin, int64_t end, Tile4x3 t43, Tile1x3 t13,
                               Tile1x1 t11) {
  int64_t n = begin;
  if (M >= 4) {
    for (; n + 3 <= end; n += 3) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) t43(m, n);
      for (; m < M; ++m) t13(m, n);
    }
  }
  for (; n < end; ++n)
    for (int64_t m = 0; m < M; ++m) t11(m, n);
}

#include "gguf_linear_avx2.h"

// Columns [begin, end) of y[M, N] = x[M, K] @ w[N, K]^T (bfloat16).
static void bf16_columns(const float* xp, const uint16_t* wp, float* yp, int64_t M, int64_t K,
                         int64_t N, int64_t begin, int64_t end) {
  columns_by3(
      M, begin, end, [&](int64_t m, int64_t n) { tile_bf16<4, 3>(xp, wp, yp, m, n, K, N); },
      [&](int64_t m, int64_t n) { tile_bf16<1, 3>(xp, wp, yp, m, n, K, N); },
      [&](int64_t m, int64_t n) { tile_bf16<1, 1>(xp, wp, yp, m, n, K, N); });
}

// y_i[M, N_i] = x[M, K] (float32) @ w_i[N_i, K]^T (bfloat16) for each weight w_i, accumulated
// in float32, K % 8 == 0: one work-shared loop over all their columns, so layers that read
// the same x (q, k and v; gate and up) are one call, and a small one (k, v: 192 columns, one
// chunk) is not left to one thread. Each column's sums are those of a call of its own.
std::vector<torch::Tensor> bf16_linears(torch::Tensor x, std::vector<torch::Tensor> ws) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 8 == 0 && !ws.empty());
  std::vector<torch::Tensor> ys;
  std::vector<int64_t> starts{0};
  for (const torch::Tensor& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
    TORCH_CHECK(w.size(1) == K);
    ys.push_back(torch::empty({M, w.size(0)}, x.options()));
    starts.push_back(starts.back() + w.size(0));
  }
  const float* xp = x.data_ptr<float>();
  penstock::WorkShare::instance().run(starts.back(), penstock::column_grain(M, K), [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t from = std::max(begin, starts[i]), to = std::min(end, starts[i + 1]);
      if (from >= to) continue;
      const uint16_t* wp = reinterpret_cast<const uint16_t*>(ws[i].data_ptr<at::BFloat16>());
      bf16_columns(xp, wp, ys[i].data_ptr<float>(), M, K, ws[i].size(0), from - starts[i],
                   to - starts[i]);
    }
  });
  return ys;
}

// y[M, N] = x[M, K] (float32) @ w[N, K]^T (bfloat16), accumulated in float32; K % 8 == 0.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) { return bf16_linears(x, {w})[0]; }

// y = x @ (w * s)^T for int8 w [N, K] with one float32 scale s per 64 weights; K % 64 == 0.
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
  penstock::WorkShare::instance().run(N, penstock::column_grain(M, K), [&](int64_t begin, int64_t end) {
    columns(
        M, begin, end, [&](int64_t m, int64_t n) { tile_i8<4, 2>(xp, wp, sp, yp, m, n, K, N); },
        [&](int64_t m, int64_t n) { tile_i8<1, 4>(xp, wp, sp, yp, m, n, K, N); },
        [&](int64_t m, int64_t n) { tile_i8<4, 1>(xp, wp, sp, yp, m, n, K, N); },
        [&](int64_t m, int64_t n) { tile_i8<1, 1>(xp, wp, sp, yp, m, n, K, N); });
  });
  return y;
}

// AVX2 CPUs have no AVX512-BF16: bfloat16 activations stay off.
bool cpu_has_avx512_bf16() { return false; }

// The kernels run without the GIL, so the server's other Python threads (the event loop
// streaming and detokenizing answers) run on another core meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear", torch::wrap_pybind_function_no_gil(bf16_linear), "bf16_linear");
  m.def("bf16_linears", torch::wrap_pybind_function_no_gil(bf16_linears), "bf16_linears");
  m.def("int8_linear", torch::wrap_pybind_function_no_gil(int8_linear), "int8_linear");
  m.def("q4_1_linear", torch::wrap_pybind_function_no_gil(q4_1_linear), "q4_1_linear");
  m.def("q8_0_linear", torch::wrap_pybind_function_no_gil(q8_0_linear), "q8_0_linear");
  m.def("cpu_has_avx512_bf16", torch::wrap_pybind_function(cpu_has_avx512_bf16),
        "cpu_has_avx512_bf16");
}
