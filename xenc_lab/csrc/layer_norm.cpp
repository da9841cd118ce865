// LayerNorm over the rows of a (T, d) stream: two passes in fp32 over the row widened once into a buffer (mean,
// then the mean of squared deviations), y = (x - mean) * rstd * weight + bias rounded once to the row's type.
// torch's CPU LayerNorm computes the same in fp32 with another summation order: outputs differ by fp32 rounding
// (bf16 and fp16 outputs are equal but where that rounding crosses a rounding boundary of the dtype).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "checks.h"
#include "norm.h"
#include "ops.h"
#include "vec.h"

namespace xenc_lab {
namespace {

template <typename T>
void layer_norm_rows(const T* x, int64_t x_stride, const T* weight, const T* bias, T* y, int64_t rows, int64_t d,
                     float eps) {
  const NormAffine norm(weight, bias, d, eps);
  // Rows in groups of kNormRows (norm.h); the next group's rows are prefetched meanwhile: a row just written by a
  // GEMM is loaded from L2 or L3.
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    Scratch row_buffer(kNormRows * norm.width * static_cast<int64_t>(sizeof(float)));
    for (int64_t r0 = begin; r0 < end; r0 += kNormRows) {
      for (int64_t r = r0 + kNormRows; r < std::min(r0 + 2 * kNormRows, end); ++r) {  // the next group's rows
        for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(T)); byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(x + r * x_stride) + byte, 0, 3);
        }
      }
      layer_norm_group(x + r0 * x_stride, x_stride, norm, y + r0 * d, d, std::min(kNormRows, end - r0),
                       row_buffer.as<float>());
    }
  });
}

}  // namespace

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                      double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "layer_norm takes a 2-D CPU tensor, got shape ", x.sizes());
  check_float_dtype(x, "layer_norm");
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, "layer_norm needs contiguous columns, got strides ", x.strides());
  for (const auto* p : {&weight, &bias}) {
    if (p->has_value()) {
      const at::Tensor& t = **p;
      TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(1) && t.is_contiguous() && t.scalar_type() == x.scalar_type(),
                  "layer_norm's weight and bias must be contiguous (", x.size(1), ",) tensors of x's dtype");
    }
  }
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) {
    return y;
  }
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const T* w = weight.has_value() ? weight->const_data_ptr<T>() : nullptr;
    const T* b = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
    layer_norm_rows<T>(x.const_data_ptr<T>(), x.stride(0), w, b, y.mutable_data_ptr<T>(), x.size(0), x.size(1),
                       static_cast<float>(eps));
  });
  return y;
}

}  // namespace xenc_lab
