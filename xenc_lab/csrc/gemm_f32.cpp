// Linear layers on fp32 GEMMs: y = x W^T + bias, then exact (erf) GELU or + residual, in one pass over y.
// - float32 layers (linear_f32): oneDNN's GEMM applies its GELU post-op to the output after the product; here it is
//   applied to each output tile while it is in L1.
// - bf16 and fp16 layers (linear_widened), rounded once to x's type: the products of bf16 numbers, and of fp16
//   numbers, are exact in fp32, and a bf16 or fp16 GEMM sums them in fp32, so fp32 FMAs on the widened values do
//   that GEMM's arithmetic (but for the order of the sums). On Intel cores without AMX they run at twice the rate
//   of the bf16 dot product; on CPUs without bf16 or fp16 units (AVX2) they are the only fast way. Done with torch's ops,
//   that takes a pass to widen x, one to widen the residual and one to round y, each over the whole tensor in
//   memory; here x is widened one block of rows at a time into a buffer that stays in cache, and the bias, GELU,
//   residual and rounding are applied to each output tile while it is in L1.
// The products are ATen's fp32 brgemm ukernel (oneDNN) on blocks of kGemmRows rows of x against blocks of
// kGemmCols columns of W^T, packed once at load ([N / kGemmCols][K][kGemmCols], zero-padded). Each output
// element is one sum over K in the ukernel's order, whatever block it falls in: rows are bitwise independent of
// the other rows and of the thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "gemm.h"
#include "ops.h"
#include "vec.h"

#if XENC_GEMM_F32
namespace xenc_lab {

LinearArgs check_linear(const char* name, const at::Tensor& x, at::ScalarType dtype, const at::Tensor& blocks,
                        at::ScalarType block_dtype, int64_t cols, const at::Tensor& bias, int64_t out_features,
                        c10::string_view activation, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == dtype, name, " takes a 2-D ", dtype,
              " CPU tensor, got ", x.scalar_type(), " of shape ", x.sizes());
  LinearArgs a{x.size(0), x.size(1), out_features, blocks.dim() == 3 ? blocks.size(0) : 0, activation == "gelu",
               nullptr, 0};
  TORCH_CHECK(a.K <= 1 || x.stride(1) == 1, name, " needs contiguous columns, got strides ", x.strides());
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(1) == a.K && blocks.size(2) == cols && blocks.is_contiguous() &&
                  blocks.scalar_type() == block_dtype,
              name, "'s weight must be ", block_dtype == at::kHalf ? "float16" : "float32", " blocks (N / ", cols,
              ", ", a.K, ", ", cols, "), got ", blocks.scalar_type(), " ", blocks.sizes());
  TORCH_CHECK(a.N > 0 && (a.N + cols - 1) / cols == a.nblk, "out_features ", a.N, " does not fit ", a.nblk,
              " blocks of ", cols, " columns");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == a.nblk * cols && bias.is_contiguous() &&
                  bias.scalar_type() == at::kFloat,
              name, "'s bias must be a float32 (", a.nblk * cols, ",) tensor, got ", bias.sizes());
  TORCH_CHECK(a.gelu || activation == "none", name, "'s activation is \"none\" or \"gelu\", got ", activation);
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(!a.gelu, name, " adds a residual to the plain product only");
    TORCH_CHECK(r.dim() == 2 && r.size(0) == a.M && r.size(1) == a.N && r.scalar_type() == dtype &&
                    (a.N <= 1 || r.stride(1) == 1),
                name, "'s residual must be a ", dtype, " (", a.M, ", ", a.N, ") tensor with contiguous columns, got ",
                r.scalar_type(), " ", r.sizes());
    a.res = r.const_data_ptr();
    a.res_stride = r.stride(0);
  }
  return a;
}

namespace {

constexpr int64_t kGemmRows = 96;  // rows of x per block: 96 x 384 fp32 (x widened) stays in L2
constexpr int64_t kGemmCols = 64;  // columns of W^T per block: a 96 x 64 fp32 output tile, 24 KB, stays in L1

// y = x W^T + bias, GELU or + residual, y of x's type T (float, or BFloat16 or Half widened a block at a time).
template <typename T>
at::Tensor linear_on_fp32(const char* name, const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& bias,
                          int64_t out_features, c10::string_view activation,
                          const std::optional<at::Tensor>& residual) {
  constexpr bool widen = !std::is_same_v<T, float>;
  const LinearArgs args = check_linear(name, x, c10::CppTypeToScalarType<T>::value, blocks, at::kFloat, kGemmCols,
                                       bias, out_features, activation, residual);
  const int64_t M = args.M, K = args.K, N = args.N, nblk = args.nblk, res_stride = args.res_stride;
  const bool gelu = args.gelu;
  const T* res = static_cast<const T*>(args.res);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) {
    return y;
  }
  const T* X = x.const_data_ptr<T>();
  const float* W = blocks.const_data_ptr<float>();
  const float* B = bias.const_data_ptr<float>();
  T* Y = y.mutable_data_ptr<T>();
  const int64_t x_stride = x.stride(0), mblk = (M + kGemmRows - 1) / kGemmRows, ldk = std::max<int64_t>(K, 1);
  // Blocks in row-major order, so that a thread's consecutive blocks share rows of x (widened once).
  at::parallel_for(0, mblk * nblk, 1, [&](int64_t begin, int64_t end) {
    Scratch panel(widen ? kGemmRows * ldk * static_cast<int64_t>(sizeof(float)) : 0);
    Scratch tile(kGemmRows * kGemmCols * static_cast<int64_t>(sizeof(float)));
    float* C = tile.as<float>();
    int64_t widened = -1;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t mi = b / nblk, ni = b % nblk, m0 = mi * kGemmRows, n0 = ni * kGemmCols;
      const int64_t rows = std::min(kGemmRows, M - m0);
      const float* A;
      int64_t lda;
      if constexpr (widen) {
        A = panel.as<float>();
        lda = ldk;
        if (mi != widened) {
          for (int64_t r = 0; r < rows; ++r) {
            const T* src = X + (m0 + r) * x_stride;
            for (int64_t c = 0; c < K; c += 16) {
              const int64_t n = std::min<int64_t>(16, K - c);
              store_first(panel.as<float>() + r * ldk + c, load_first(src + c, n), n);
            }
          }
          widened = mi;
        }
      } else {
        A = X + m0 * x_stride;
        lda = std::max<int64_t>(x_stride, 1);
      }
      if (K > 0) {
        at::native::cpublas::brgemm(rows, kGemmCols, K, lda, kGemmCols, kGemmCols, false, A, W + ni * K * kGemmCols,
                                    C, false);
      } else {
        std::fill(C, C + rows * kGemmCols, 0.f);
      }
      const int64_t cols = std::min(kGemmCols, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        T* out = Y + (m0 + r) * N + n0;
        for (int64_t c = 0; c < cols; c += 16) {
          const int64_t n = std::min<int64_t>(16, cols - c);
          const vf v = load(C + r * kGemmCols + c) + loadu(B + n0 + c);
          store_first(out + c, finish(v, gelu, res ? res + (m0 + r) * res_stride + n0 + c : nullptr, n), n);
        }
      }
    }
    at::native::cpublas::brgemm_release(false);
  });
  return y;
}

}  // namespace

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& bias, int64_t out_features,
                      c10::string_view activation, const std::optional<at::Tensor>& residual) {
  return linear_on_fp32<float>("linear_f32", x, blocks, bias, out_features, activation, residual);
}

at::Tensor linear_widened(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& bias, int64_t out_features,
                          c10::string_view activation, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "linear_widened takes bfloat16 or float16 x, got ", x.scalar_type());
  if (x.scalar_type() == at::kHalf) {
    return linear_on_fp32<Half>("linear_widened", x, blocks, bias, out_features, activation, residual);
  }
  return linear_on_fp32<BFloat16>("linear_widened", x, blocks, bias, out_features, activation, residual);
}

}  // namespace xenc_lab
#endif  // XENC_GEMM_F32
