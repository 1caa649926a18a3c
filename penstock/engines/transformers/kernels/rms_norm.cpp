// Llama's RMS norm of float32 rows in one call: the decode step calls it twice a layer,
// where torch's six ops cost ~10x the arithmetic. Every op is rounded as transformers'
// LlamaRMSNorm rounds it in float32 (squares, their mean, + eps, 1 / sqrt, two products),
// the squares summed by at::sum itself, so the summation order is torch's and the result
// is the same bits.

#include "rms_norm.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace {

void check_rows(const at::Tensor& rows, const at::Tensor& weight) {
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.is_contiguous() &&
                  rows.device().is_cpu(),
              "rows must be 2-D contiguous float32 on the CPU");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == rows.size(1),
              "the norm's weight must be float32, as wide as the rows");
}

// No product here meets a sum the compiler could fuse it with: each op rounds on its own.
at::Tensor normalized(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const float* h = hidden.data_ptr<float>();
  at::Tensor squares = at::empty_like(hidden);
  float* square = squares.data_ptr<float>();
  for (int64_t i = 0; i < rows * width; ++i) square[i] = h[i] * h[i];
  // at::mean of float32 on the CPU is at::sum, then a division by the width.
  const at::Tensor sums = at::sum(squares, -1, true);
  const float* sum = sums.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::Tensor out = at::empty_like(hidden);
  float* o = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float mean = sum[r] / static_cast<float>(width);
    const float inverse = 1.0f / std::sqrt(mean + epsilon);
    const float* row = h + r * width;
    float* row_out = o + r * width;
    for (int64_t c = 0; c < width; ++c) {
      const float scaled = row[c] * inverse;
      row_out[c] = w[c] * scaled;
    }
  }
  return out;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  check_rows(hidden, weight);
  return normalized(hidden, weight, eps);
}

// hidden += delta (the residual stream, in place), then its norm.
at::Tensor add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  check_rows(hidden, weight);
  TORCH_CHECK(delta.scalar_type() == at::kFloat && delta.is_contiguous() &&
                  delta.numel() == hidden.numel(),
              "delta must be float32 contiguous, shaped as the rows");
  float* h = hidden.data_ptr<float>();
  const float* d = delta.data_ptr<float>();
  for (int64_t i = 0; i < hidden.numel(); ++i) h[i] = h[i] + d[i];
  return normalized(hidden, weight, eps);
}
