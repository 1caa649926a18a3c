// Decode attention over the KV pool's blocks, read in place (see paged_attention.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "rms_norm.h"
#include "work_share.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGED_AVX2 1
static inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

static inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(PAGED_AVX2)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  sum = sum8(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

static inline int64_t slot_of(const int32_t* blocks, int64_t token, int64_t block_size) {
  return static_cast<int64_t>(blocks[token / block_size]) * block_size + token % block_size;
}

// out = sum over the row's n tokens of weights[t] * values[slot(t)], dim floats each (the
// values of one KV head, ``stride`` floats apart from slot to slot); 64 floats of out
// stay in registers while every token is read.
static inline void weighted_sum(const float* weights, const float* values, int64_t stride,
                                const int32_t* blocks, int64_t block_size, int64_t n,
                                int64_t dim, float* out) {
  int64_t d = 0;
#ifdef __AVX512F__
  for (; d + 64 <= dim; d += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t t = 0; t < n; ++t) {
      const float* value = values + slot_of(blocks, t, block_size) * stride + d;
      const __m512 w = _mm512_set1_ps(weights[t]);
      a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(value), a0);
      a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 16), a1);
      a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 32), a2);
      a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 48), a3);
    }
    _mm512_storeu_ps(out + d, a0);
    _mm512_storeu_ps(out + d + 16, a1);
    _mm512_storeu_ps(out + d + 32, a2);
    _mm512_storeu_ps(out + d + 48, a3);
  }
#elif defined(PAGED_AVX2)
  for (; d + 64 <= dim; d += 64) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const float* value = values + slot_of(blocks, t, block_size) * stride + d;
      const __m256 w = _mm256_set1_ps(weights[t]);
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + 8 * j), a[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + d + 8 * j, a[j]);
  }
  for (; d + 8 <= dim; d += 8) {
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t)
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(weights[t]),
                           _mm256_loadu_ps(values + slot_of(blocks, t, block_size) * stride + d), a0);
    _mm256_storeu_ps(out + d, a0);
  }
#endif
  for (; d < dim; ++d) {
    float sum = 0;
    for (int64_t t = 0; t < n; ++t)
      sum += weights[t] * values[slot_of(blocks, t, block_size) * stride + d];
    out[d] = sum;
  }
}

// exp(x) for x <= 0 (scores minus their maximum), within 2 ulp of expf: Cody-Waite
// range reduction and Cephes' polynomial, branch-free so the loop over a row vectorizes.
static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Keys and queries rotated as transformers rotates them: x * cos + roll(x, dim / 2) * sin,
// ``sin``'s first half negated (see llama_decode.py), every product and sum rounded on its
// own as torch's ops round them, hence without contraction into fused multiply-adds.
__attribute__((optimize("fp-contract=off"))) static void rotate(const float* x,
                                                                const float* cos,
                                                                const float* sin, int64_t dim,
                                                                float* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const float straight = x[i] * cos[i];
    const float turned = x[i < half ? i + half : i - half] * sin[i];
    out[i] = straight + turned;
  }
}

namespace {

// One decode step's rows over one layer's slots: each row's queries ``q`` (``heads * dim``
// floats a row) against the keys and values its block table names.
struct RowAttention {
  const float* k;
  const float* v;
  const int32_t* blocks;
  const int32_t* length;
  int64_t heads, kv_heads, dim, width, block_size;
  float scale;

  void check(int64_t rows, int64_t slots) const {
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(length[r] >= 1 && length[r] <= width * block_size,
                  "row length out of its table");
    for (int64_t i = 0; i < rows * width; ++i)
      TORCH_CHECK(blocks[i] >= 0 && (blocks[i] + 1) * block_size <= slots,
                  "block out of the pool");
  }

  // Each of the row's slots (every KV head's keys, contiguous) is read once for all its
  // query heads, in slot order.
  void attend(int64_t r, const float* row_q, float* row_o, std::vector<float>& scores) const {
    const int64_t n = length[r], group = heads / kv_heads;
    const int32_t* row_blocks = blocks + r * width;
    scores.resize(heads * n);
    for (int64_t t = 0; t < n; ++t) {
      const float* key = k + slot_of(row_blocks, t, block_size) * kv_heads * dim;
      for (int64_t head = 0; head < heads; ++head)
        scores[head * n + t] = dot(row_q + head * dim, key + (head / group) * dim, dim) * scale;
    }
    for (int64_t head = 0; head < heads; ++head) {
      float* line = scores.data() + head * n;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) top = std::max(top, line[t]);
      float sum = 0;
      for (int64_t t = 0; t < n; ++t) line[t] = exp_nonpositive(line[t] - top);
      for (int64_t t = 0; t < n; ++t) sum += line[t];
      const float inverse = 1.0f / sum;
      for (int64_t t = 0; t < n; ++t) line[t] *= inverse;
    }
    for (int64_t head = 0; head < heads; ++head)
      weighted_sum(scores.data() + head * n, v + (head / group) * dim, kv_heads * dim,
                   row_blocks, block_size, n, dim, row_o + head * dim);
  }
};

void check_pool(const torch::Tensor& table, const torch::Tensor& lengths, int64_t rows) {
  TORCH_CHECK(table.scalar_type() == torch::kInt && table.is_contiguous() && table.dim() == 2);
  TORCH_CHECK(lengths.scalar_type() == torch::kInt && lengths.is_contiguous());
  TORCH_CHECK(table.size(0) == rows && lengths.numel() == rows);
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor keys,
                                     torch::Tensor values, torch::Tensor table,
                                     torch::Tensor lengths, double scale, int64_t block_size) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat && query.is_contiguous() && query.dim() == 3);
  TORCH_CHECK(keys.scalar_type() == torch::kFloat && keys.is_contiguous() && keys.dim() == 3);
  TORCH_CHECK(values.scalar_type() == torch::kFloat && values.is_contiguous());
  TORCH_CHECK(values.sizes() == keys.sizes());
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(1);
  TORCH_CHECK(keys.size(2) == dim && heads % kv_heads == 0);
  check_pool(table, lengths, rows);
  const RowAttention attention{keys.data_ptr<float>(), values.data_ptr<float>(),
                               table.data_ptr<int32_t>(), lengths.data_ptr<int32_t>(),
                               heads, kv_heads, dim, table.size(1), block_size,
                               static_cast<float>(scale)};
  attention.check(rows, keys.size(0));
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  penstock::WorkShare::instance().run(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t r = begin; r < end; ++r)
      attention.attend(r, q + r * heads * dim, o + r * heads * dim, scores);
  });
  return out;
}

// A decode step's attention in layer ``layer`` from its linear layers' outputs: ``query``
// ``[rows, heads * dim]``, ``key`` and ``value`` ``[rows, kv heads * dim]``. Queries and
// keys are rotated (``cos``, ``sin``: ``[rows, dim]``), each row's key and value written
// into its slot (``slots``, int64) of the pool (``keys``, ``values``: ``[layers, slots, kv
// heads, dim]``), then each row attends over its own slots. Returns ``[rows, heads * dim]``.
torch::Tensor rotary_decode_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                      torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                                      torch::Tensor values, int64_t layer, torch::Tensor slots,
                                      torch::Tensor table, torch::Tensor lengths, double scale,
                                      int64_t block_size) {
  TORCH_CHECK(keys.scalar_type() == torch::kFloat && keys.is_contiguous() && keys.dim() == 4);
  TORCH_CHECK(values.scalar_type() == torch::kFloat && values.is_contiguous());
  TORCH_CHECK(values.sizes() == keys.sizes() && layer >= 0 && layer < keys.size(0));
  const int64_t pool = keys.size(1), kv_heads = keys.size(2), dim = keys.size(3);
  const int64_t rows = query.size(0);
  for (const torch::Tensor* part : {&query, &key, &value, &cos, &sin})
    TORCH_CHECK(part->scalar_type() == torch::kFloat && part->is_contiguous() &&
                    part->dim() >= 2 && part->size(0) == rows,
                "query, key, value, cos and sin must be float32 rows");
  TORCH_CHECK(query.numel() % (rows * dim) == 0 && dim % 2 == 0);
  const int64_t heads = query.numel() / (rows * dim);
  TORCH_CHECK(heads % kv_heads == 0 && key.numel() == rows * kv_heads * dim &&
              value.numel() == key.numel() && cos.numel() == rows * dim &&
              sin.numel() == cos.numel());
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() &&
              slots.numel() == rows);
  check_pool(table, lengths, rows);
  const int64_t layer_floats = pool * kv_heads * dim;
  float* layer_keys = keys.data_ptr<float>() + layer * layer_floats;
  float* layer_values = values.data_ptr<float>() + layer * layer_floats;
  const RowAttention attention{layer_keys, layer_values, table.data_ptr<int32_t>(),
                               lengths.data_ptr<int32_t>(), heads, kv_heads, dim, table.size(1),
                               block_size, static_cast<float>(scale)};
  attention.check(rows, pool);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slot[r] >= 0 && slot[r] < pool, "slot out of the pool");
  auto out = torch::empty({rows, heads * dim}, query.options());
  const float* q = query.data_ptr<float>();
  const float* new_keys = key.data_ptr<float>();
  const float* new_values = value.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // A row writes its own slot, in a block no other row of the step writes or reads.
  penstock::WorkShare::instance().run(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, rotated(heads * dim);
    for (int64_t r = begin; r < end; ++r) {
      const float* row_c = c + r * dim;
      const float* row_s = s + r * dim;
      for (int64_t head = 0; head < kv_heads; ++head)
        rotate(new_keys + (r * kv_heads + head) * dim, row_c, row_s, dim,
               layer_keys + (slot[r] * kv_heads + head) * dim);
      std::memcpy(layer_values + slot[r] * kv_heads * dim, new_values + r * kv_heads * dim,
                  kv_heads * dim * sizeof(float));
      for (int64_t head = 0; head < heads; ++head)
        rotate(q + (r * heads + head) * dim, row_c, row_s, dim, rotated.data() + head * dim);
      attention.attend(r, rotated.data(), o + r * heads * dim, scores);
    }
  });
  return out;
}

// The attention kernels run without the GIL, so the server's other Python threads (the
// event loop streaming and detokenizing answers) run on another core meanwhile; the norms
// are too short to give it up.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", torch::wrap_pybind_function_no_gil(paged_decode_attention),
        "paged_decode_attention");
  m.def("rotary_decode_attention", torch::wrap_pybind_function_no_gil(rotary_decode_attention),
        "rotary_decode_attention");
  m.def("rms_norm", &rms_norm, "rms_norm");
  m.def("add_rms_norm", &add_rms_norm, "add_rms_norm");
}
