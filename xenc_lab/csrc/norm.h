// LayerNorm of a group of rows, as layer_norm.cpp computes it: what the layer_norm op and the int8 GEMMs that end
// in a LayerNorm (gemm_int8.cpp) share, so that both give the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace xenc_lab {

// Rows per group: a row's passes depend on each other through its sums (two horizontal reductions and a square
// root), the rows do not, so the core overlaps one row's reductions with the next row's pass instead of waiting.
constexpr int64_t kNormRows = 4;

// A LayerNorm's weight and bias (either may be absent: 1 and 0) widened to float32 once, zero-padded to whole
// registers, with its width d and epsilon.
struct NormAffine {
  int64_t d, width;
  float eps;
  Scratch affine;
  template <typename T>
  NormAffine(const T* weight, const T* bias, int64_t d_, float eps_)
      : d(d_), width(round_up(d_, 16)), eps(eps_), affine(2 * width * static_cast<int64_t>(sizeof(float))) {
    float* w = this->weight();
    float* b = this->bias();
    for (int64_t c = 0; c < width; c += 16) {
      const int64_t n = std::clamp<int64_t>(d - c, 0, 16);
      store(w + c, weight ? load_first(weight + c, n) : keep_lanes(splat(1.f), lane_range(0, n), 0.f));
      store(b + c, bias ? load_first(bias + c, n) : zeros());
    }
  }
  float* weight() const { return affine.as<float>(); }
  float* bias() const { return affine.as<float>() + width; }
};

// LayerNorm of n <= kNormRows rows of x (row stride x_stride) into y (row stride y_stride; y may be x): two passes in
// fp32 over each row widened once into `buffer` (kNormRows x norm.width floats), the mean, then the mean of squared
// deviations; y = (x - mean) * rstd * weight + bias, rounded once to T.
template <typename T>
void layer_norm_group(const T* x, int64_t x_stride, const NormAffine& norm, T* y, int64_t y_stride, int64_t n,
                      float* buffer) {
  const int64_t d = norm.d, width = norm.width;
  const float inv_d = 1.f / static_cast<float>(d);
  float mean[kNormRows], rstd[kNormRows];
  for (int64_t i = 0; i < n; ++i) {
    const T* xr = x + i * x_stride;
    float* buf = buffer + i * width;
    vf sum = zeros();
    for (int64_t c = 0; c < width; c += 16) {
      const vf v = load_first(xr + c, std::min<int64_t>(16, d - c));  // zero past d
      store(buf + c, v);
      sum = sum + v;
    }
    mean[i] = reduce_add(sum) * inv_d;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* buf = buffer + i * width;
    const vf m = splat(mean[i]);
    vf squares = zeros();
    for (int64_t c = 0; c < width; c += 16) {
      vf dev = load(buf + c) - m;
      if (c + 16 > d) {
        dev = keep_lanes(dev, lane_range(0, d - c), 0.f);
      }
      squares = fma(dev, dev, squares);
    }
    rstd[i] = 1.f / std::sqrt(reduce_add(squares) * inv_d + norm.eps);
  }
  const float* w = norm.weight();
  const float* b = norm.bias();
  for (int64_t i = 0; i < n; ++i) {
    const float* buf = buffer + i * width;
    const vf m = splat(mean[i]), s = splat(rstd[i]);
    T* yr = y + i * y_stride;
    for (int64_t c = 0; c < width; c += 16) {
      const vf v = fma((load(buf + c) - m) * s, load(w + c), load(b + c));
      store_first(yr + c, v, std::min<int64_t>(16, d - c));
    }
  }
}

}  // namespace xenc_lab
