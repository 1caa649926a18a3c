// The RMS norms of a decode step (see rms_norm.cpp).
#pragma once

#include <ATen/ATen.h>

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight,
                        double eps);
