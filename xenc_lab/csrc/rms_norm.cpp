// The decoders' row ops: RMSNorm over the rows of a (T, d) stream, and rotary positions applied to every head of
// a (T, G, D) stream, each head first normalized by a per-head RMSNorm where a weight is given (Qwen3's q and k
// norms). One read and one write of each row instead of torch's four to six passes.
//
// Numerics are transformers': the mean of squares, its reciprocal square root and the normalized row in fp32; in
// 16 bits the normalized row is rounded to the dtype before the weight multiplies it, and the rotary products
// x * cos and rotate_half(x) * sin are each rounded before their sum is. fp32 sums run in another order than torch's:
// outputs differ by fp32 rounding (16-bit ones by a rounding step where that crosses a rounding boundary).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "checks.h"
#include "ops.h"
#include "vec.h"

namespace xenc_lab {
namespace {

constexpr int64_t kMaxRopeDim = 512;

// 1 / sqrt(mean(x^2) + eps) of one row of d elements.
template <typename T>
XENC_INLINE float inverse_rms(const T* x, int64_t d, float eps) {
  vf squares = zeros();
  for (int64_t c = 0; c < d; c += 16) {
    const vf v = load_first(x + c, std::min<int64_t>(16, d - c));
    squares = fma(v, v, squares);
  }
  return 1.f / std::sqrt(reduce_add(squares) / static_cast<float>(d) + eps);
}

// weight * (x * r): x * r in fp32, rounded to T, times the weight (of T, or already widened to float), rounded to T.
template <typename T, typename W>
XENC_INLINE vf normed(const T* x, const W* w, float r, int64_t c, int64_t n) {
  return rounded<T>(load_first(w + c, n) * rounded<T>(load_first(x + c, n) * splat(r)));
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = x + i * x_stride;
      const float r = inverse_rms(xr, d, eps);
      T* yr = y + i * d;
      for (int64_t c = 0; c < d; c += 16) {
        const int64_t n = std::min<int64_t>(16, d - c);
        store_first(yr + c, normed(xr, w, r, c, n), n);
      }
    }
  });
}

// Each head row h of token t: normalized with weight w[h] (if w), then x * cos[t] + roll(x, D / 2) * sin[t], sin
// holding the first half's sines negated (rotate_half(x) * sin, as ``models.decoder.rotate`` reads it). The weights
// are widened to fp32 once per call and a token's cos and sin once for all its heads.
template <typename T>
void rope_rows(const T* x, int64_t x_stride, int64_t heads, const T* w, const T* cos, const T* sin, T* y,
               int64_t tokens, int64_t dim, float eps) {
  const int64_t half = dim / 2, weights = w ? heads * dim : 0;
  Scratch widened(weights * static_cast<int64_t>(sizeof(float)));  // head h's weights at h * dim
  float* wide_w = widened.as<float>();
  for (int64_t i = 0; i < weights; i += 16) {
    const int64_t n = std::min<int64_t>(16, weights - i);
    store_first(wide_w + i, load_first(w + i, n), n);
  }
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    float buf[2 * kMaxRopeDim + 16];  // the head row twice, end to end: its roll by D / 2 is a window of it
    float c_t[kMaxRopeDim + 16], s_t[kMaxRopeDim + 16];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < dim; c += 16) {
        const int64_t n = std::min<int64_t>(16, dim - c);
        store_first(c_t + c, load_first(cos + t * dim + c, n), n);
        store_first(s_t + c, load_first(sin + t * dim + c, n), n);
      }
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * x_stride + h * dim;
        const float r = w ? inverse_rms(xr, dim, eps) : 0.f;
        for (int64_t c = 0; c < dim; c += 16) {
          const int64_t n = std::min<int64_t>(16, dim - c);
          const vf v = w ? normed(xr, wide_w + h * dim, r, c, n) : load_first(xr + c, n);
          store_first(buf + c, v, n);
          store_first(buf + dim + c, v, n);
        }
        T* yr = y + (t * heads + h) * dim;
        for (int64_t c = 0; c < dim; c += 16) {
          const int64_t n = std::min<int64_t>(16, dim - c);
          const vf a = rounded<T>(load_first(buf + c, n) * load_first(c_t + c, n));
          const vf b = rounded<T>(load_first(buf + half + c, n) * load_first(s_t + c, n));
          store_first(yr + c, a + b, n);
        }
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, " takes CPU tensors");
  check_float_dtype(x, op);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1) && (x.size(0) <= 1 || x.stride(0) >= 0),
              "rms_norm takes a 2-D tensor with contiguous columns, got shape ", x.sizes(), " strides ", x.strides());
  check_like(weight, x, {x.size(1)}, "rms_norm's weight");
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() > 0) {
    dispatch_float(x, [&](auto tag) {
      using T = decltype(tag);
      rms_norm_rows<T>(x.const_data_ptr<T>(), x.stride(0), weight.const_data_ptr<T>(), y.mutable_data_ptr<T>(),
                       x.size(0), x.size(1), static_cast<float>(eps));
    });
  }
  return y;
}

at::Tensor rope(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps, const at::Tensor& cos,
                const at::Tensor& sin) {
  check_rows(x, "rope");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && (x.size(0) <= 1 || x.stride(0) >= 0),
              "rope takes a (tokens, heads, head_dim) tensor whose heads lie end to end in each row, got shape ",
              x.sizes(), " strides ", x.strides());
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0 && dim <= kMaxRopeDim, "rope's head_dim must be even and at most ", kMaxRopeDim,
              ", got ", dim);
  if (weight.has_value()) {
    check_like(*weight, x, {heads, dim}, "rope's weight");
  }
  check_like(cos, x, {tokens, dim}, "rope's cos");
  check_like(sin, x, {tokens, dim}, "rope's sin");
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() > 0) {
    dispatch_float(x, [&](auto tag) {
      using T = decltype(tag);
      rope_rows<T>(x.const_data_ptr<T>(), x.stride(0), heads, weight ? weight->const_data_ptr<T>() : nullptr,
                   cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), y.mutable_data_ptr<T>(), tokens, dim,
                   static_cast<float>(eps));
    });
  }
  return y;
}

}  // namespace xenc_lab
