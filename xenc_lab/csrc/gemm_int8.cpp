// Linear layers in int8 (quantization="int8"): y = dequant(q(x) q(W)^T) + bias, then exact GELU or + residual.
// - W is int8, symmetric, one scale per output channel, quantized once at load (xenc_lab/cpu/int8.py).
// - x is quantized here, per row (token), to unsigned bytes with a zero point, with no calibration: the row's range
//   [min(x, 0), max(x, 0)] in 255 steps of s, u = round(x / s) + z, z = round(-min / s). A row after a GELU (mostly
//   positive) keeps all 8 bits this way, not 7 (docs/int8.md measures both).
// - The products are ATen's u8 x s8 -> s32 brgemm ukernel (oneDNN: AVX512-VNNI's vpdpbusd, AVX-VNNI, AMX-INT8):
//   the zero point times the column sums sum_k W[n, k] (computed at load) is taken off each int32 sum, which is then
//   exact: sum_k (u[m, k] - z[m]) W[n, k].
// - Epilogue on each output tile while it is in cache: sum * s[m] * scale_w[n] + bias[n] in fp32, then GELU
//   or the residual, rounded once to x's type (float32, bfloat16 or float16).
// W^T is packed once at load as blocks (N / kInt8Cols, K4 / 4, kInt8Cols, 4) of int8 (K4: K rounded up to 4, the
// VNNI layout: 4 consecutive k of one column side by side), zero-padded. A row's result depends on that row alone.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "gemm.h"
#include "ops.h"
#include "vec.h"

#if XENC_GEMM_INT8
namespace xenc_lab {
namespace {

constexpr int64_t kInt8Rows = 96;  // rows of x per block, quantized once into a u8 panel that stays in L2
constexpr int64_t kInt8Cols = 64;  // columns of W^T per block: a 96 x 64 int32 tile, 24 KB, stays in L1

// Quantizes `rows` rows of x (stride x_stride, K columns) into `panel` (rows x K4 bytes, padded with zeros), their
// scales into `scales` and zero points into `zeros`; `wide` is a float buffer of K. As ``cpu.int8.quantize_rows``.
template <typename T>
void quantize_rows(const T* x, int64_t x_stride, int64_t rows, int64_t K, int64_t K4, uint8_t* panel, float* scales,
                   int32_t* zero_points, float* wide) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = x + r * x_stride;
    vf largest = zeros(), smallest = zeros();  // zero is in every row's range
    for (int64_t c = 0; c < K; c += 16) {
      const int64_t n = std::min<int64_t>(16, K - c);
      const vf v = load_first(src + c, n);  // lanes past K are zero
      store_first(wide + c, v, n);
      largest = vmax(largest, v);
      smallest = vmax(smallest, splat(0.f) - v);
    }
    const float low = -reduce_max(smallest), high = reduce_max(largest);
    const float s = std::max((high - low) / 255.f, 1e-30f);
    const float z = std::nearbyint(-low / s);
    scales[r] = s;
    zero_points[r] = static_cast<int32_t>(z);
    uint8_t* out = panel + r * K4;
    for (int64_t c = 0; c < K; ++c) {  // round to nearest even, as torch's round (vectorized by the compiler)
      out[c] = static_cast<uint8_t>(std::min(std::max(std::nearbyint(wide[c] / s) + z, 0.f), 255.f));
    }
    for (int64_t c = K; c < K4; ++c) {
      out[c] = 0;
    }
  }
}

template <typename T>
at::Tensor linear_int8_on(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& correction,
                          const at::Tensor& weight_scale, const at::Tensor& bias, int64_t out_features,
                          c10::string_view activation, const std::optional<at::Tensor>& residual) {
  const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "linear_int8 takes a 2-D CPU tensor, got shape ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features, K4 = (K + 3) / 4 * 4;
  TORCH_CHECK(K <= 1 || x.stride(1) == 1, "linear_int8 needs contiguous columns, got strides ", x.strides());
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(1) == K4 / 4 && blocks.size(2) == kInt8Cols && blocks.size(3) == 4 &&
                  blocks.is_contiguous() && blocks.scalar_type() == at::kChar,
              "linear_int8's weight must be int8 blocks (N / ", kInt8Cols, ", ", K4 / 4, ", ", kInt8Cols,
              ", 4), got ", blocks.scalar_type(), " ", blocks.sizes());
  const int64_t nblk = blocks.size(0), width = nblk * kInt8Cols;
  TORCH_CHECK(N > 0 && (N + kInt8Cols - 1) / kInt8Cols == nblk, "out_features ", N, " does not fit ", nblk,
              " blocks of ", kInt8Cols, " columns");
  for (const at::Tensor* t : {&correction, &weight_scale, &bias}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == width && t->is_contiguous(),
                "linear_int8's per-column tensors must be (", width, ",), got ", t->sizes());
  }
  TORCH_CHECK(correction.scalar_type() == at::kInt && weight_scale.scalar_type() == at::kFloat &&
                  bias.scalar_type() == at::kFloat,
              "linear_int8 takes an int32 correction and float32 scales and bias");
  const bool gelu = activation == "gelu";
  TORCH_CHECK(gelu || activation == "none", "linear_int8's activation is \"none\" or \"gelu\", got ", activation);
  const T* res = nullptr;
  int64_t res_stride = 0;
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(!gelu, "linear_int8 adds a residual to the plain product only");
    TORCH_CHECK(r.dim() == 2 && r.size(0) == M && r.size(1) == N && r.scalar_type() == dtype &&
                    (N <= 1 || r.stride(1) == 1),
                "linear_int8's residual must be a ", dtype, " (", M, ", ", N, ") tensor with contiguous columns");
    res = r.const_data_ptr<T>();
    res_stride = r.stride(0);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) {
    return y;
  }
  const T* X = x.const_data_ptr<T>();
  const int8_t* W = blocks.const_data_ptr<int8_t>();
  const int32_t* S = correction.const_data_ptr<int32_t>();
  const float* WS = weight_scale.const_data_ptr<float>();
  const float* B = bias.const_data_ptr<float>();
  T* Y = y.mutable_data_ptr<T>();
  const int64_t x_stride = x.stride(0), mblk = (M + kInt8Rows - 1) / kInt8Rows;
  // Blocks in row-major order, so that a thread's consecutive blocks share rows of x (quantized once).
  at::parallel_for(0, mblk * nblk, 1, [&](int64_t begin, int64_t end) {
    Scratch panel(kInt8Rows * K4);
    Scratch wide(K4 * static_cast<int64_t>(sizeof(float)));
    Scratch tile(kInt8Rows * kInt8Cols * static_cast<int64_t>(sizeof(int32_t)));
    Scratch row(kInt8Cols * static_cast<int64_t>(sizeof(float)));
    float scales[kInt8Rows];
    int32_t zero_points[kInt8Rows];
    int32_t* C = tile.as<int32_t>();
    float* F = row.as<float>();
    int64_t quantized = -1;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t mi = b / nblk, ni = b % nblk, m0 = mi * kInt8Rows, n0 = ni * kInt8Cols;
      const int64_t rows = std::min(kInt8Rows, M - m0);
      if (mi != quantized) {
        quantize_rows(X + m0 * x_stride, x_stride, rows, K, K4, panel.as<uint8_t>(), scales, zero_points,
                      wide.as<float>());
        quantized = mi;
      }
      at::native::cpublas::brgemm(rows, kInt8Cols, K4, K4, kInt8Cols, kInt8Cols, false, panel.as<uint8_t>(),
                                  W + ni * K4 * kInt8Cols, C, true);
      const int64_t cols = std::min(kInt8Cols, N - n0);
      const int32_t* s = S + n0;
      const float* ws = WS + n0;
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t* acc = C + r * kInt8Cols;
        const float xs = scales[r];
        const int32_t z = zero_points[r];
        for (int64_t c = 0; c < kInt8Cols; ++c) {  // exact int32 sums, then one fp32 scale each (vectorized)
          F[c] = static_cast<float>(acc[c] - z * s[c]) * (xs * ws[c]);
        }
        T* out = Y + (m0 + r) * N + n0;
        for (int64_t c = 0; c < cols; c += 16) {
          const int64_t n = std::min<int64_t>(16, cols - c);
          const vf v = load(F + c) + loadu(B + n0 + c);
          store_first(out + c, finish(v, gelu, res ? res + (m0 + r) * res_stride + n0 + c : nullptr, n), n);
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

}  // namespace

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& correction,
                       const at::Tensor& weight_scale, const at::Tensor& bias, int64_t out_features,
                       c10::string_view activation, const std::optional<at::Tensor>& residual) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return linear_int8_on<float>(x, blocks, correction, weight_scale, bias, out_features, activation, residual);
    case at::kBFloat16:
      return linear_int8_on<BFloat16>(x, blocks, correction, weight_scale, bias, out_features, activation, residual);
    case at::kHalf:
      return linear_int8_on<Half>(x, blocks, correction, weight_scale, bias, out_features, activation, residual);
    default:
      TORCH_CHECK(false, "linear_int8 takes float32, bfloat16 or float16 x, got ", x.scalar_type());
  }
}

}  // namespace xenc_lab
#endif  // XENC_GEMM_INT8
