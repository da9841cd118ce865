// What the GEMMs of linear layers (gemm_f32.cpp, gemm_half.cpp) share: their argument checks and their epilogue,
// the exact GELU or the residual.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "vec.h"

#if XENC_GEMM_F32
namespace xenc_lab {

// erf by Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7), the approximation torch's vectorized CPU erf uses;
// exp(-x^2) by exp2_nonpositive.
XENC_INLINE vf erf_as(vf x) {
  const vf sign = vand(x, splat(-0.f));
  const vf a = vandnot(splat(-0.f), x);
  const vf d = fma(splat(0.3275911f), a, splat(1.f));
  vf t = recip_estimate(d);  // then one Newton step (a division would cost more than the rest)
  t = fma(fnma(d, t, splat(1.f)), t, t);
  vf r = fma(splat(1.061405429f), t, splat(-1.453152027f));
  r = fma(r, t, splat(1.421413741f));
  r = fma(r, t, splat(-0.284496736f));
  r = fma(r, t, splat(0.254829592f));
  const vf e = exp2_nonpositive((a * a) * splat(-1.4426950408889634f));
  return vor(fnma(r * t, e, splat(1.f)), sign);
}

// The arguments the GEMMs take: x (M, K) of `dtype` with contiguous columns; W^T in blocks (N / cols, K, cols) of
// `block_dtype`, zero-padded; a float32 bias padded likewise; "none" or "gelu"; an optional (M, N) residual of
// `dtype`.
struct LinearArgs {
  int64_t M, K, N, nblk;
  bool gelu;
  const void* res;
  int64_t res_stride;
};

// Checks the arguments (raising on a mismatch) and returns the shapes, the activation and the residual.
LinearArgs check_linear(const char* name, const at::Tensor& x, at::ScalarType dtype, const at::Tensor& blocks,
                        at::ScalarType block_dtype, int64_t cols, const at::Tensor& bias, int64_t out_features,
                        c10::string_view activation, const std::optional<at::Tensor>& residual);

// The last step of every GEMM here: exact GELU, or + the residual's n lanes at `res` (where there is one).
template <typename T>
XENC_INLINE vf finish(vf v, bool gelu, const T* res, int64_t n) {
  if (gelu) {
    return v * splat(0.5f) * (splat(1.f) + erf_as(v * splat(0.70710678118654752f)));
  }
  return res ? v + load_first(res, n) : v;
}

}  // namespace xenc_lab
#endif  // XENC_GEMM_F32
