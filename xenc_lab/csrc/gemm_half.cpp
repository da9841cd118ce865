// bf16 linear layers on fp16 FMAs: y = x W^T + bias, then exact (erf) GELU or + residual, rounded once to bf16.
// An AVX512-FP16 FMA does 32 multiply-adds where an fp32 FMA does 16, at the same rate: on Intel cores without AMX
// that is twice the fp32 GEMM's rate and four times the bf16 dot product's. bf16 values are exact in fp16 (8
// significant bits of 11) when they lie in its normal range, which scaling by powers of two ensures: each row of x
// by its own 2^e (its largest element to [64, 128)), W by 2^t (its largest to [1, 2)), undone in fp32 at the end.
// The products and sums run in fp16 over kHalfChunk consecutive k, where no sum can exceed 64 * 128 * 2 = 16384
// (fp16's largest is 65504), and the chunks' sums add up in fp32. Each fp16 step rounds to 11 bits, against the
// 8 bits the bf16 output keeps. A row's arithmetic depends on that row alone: rows are bitwise independent of the
// other rows and of the thread count.
//
// Register blocking: kHalfRows rows x kHalfVecs 32-column fp16 vectors of accumulators (24 of the 32 zmm
// registers); each x element is stored twice in a 32-bit word, so that one broadcast load (no shuffle) fills all
// 32 lanes. W^T is packed once at load into fp16 blocks [N / kHalfCols][K][kHalfCols], zero-padded.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "gemm.h"
#include "ops.h"
#include "vec.h"

#if XENC_HALF_GEMM
namespace xenc_lab {
namespace {

constexpr int64_t kHalfRows = 6;
constexpr int64_t kHalfVecs = 4;
constexpr int64_t kHalfCols = 32 * kHalfVecs;
constexpr int64_t kHalfChunk = 64;
constexpr int64_t kHalfBlockRows = 96;  // rows of x per block (a multiple of kHalfRows), converted once per block
constexpr int kHalfRowMax = 7;          // each row of x is scaled so that its largest element is below 2^7

// sums[r][c] (fp32, kHalfRows x kHalfCols) = rows P[r] (fp16 pairs, ldp apart) times W^T block B (K x kHalfCols).
XENC_INLINE void half_tile(const uint32_t* P, int64_t ldp, const Half* B, int64_t K, float* sums) {
  if (K == 0) {
    std::fill(sums, sums + kHalfRows * kHalfCols, 0.f);
  }
  for (int64_t k0 = 0; k0 < K; k0 += kHalfChunk) {
    __m512h acc[kHalfRows][kHalfVecs];
#pragma GCC unroll 8
    for (int r = 0; r < kHalfRows; ++r) {
#pragma GCC unroll 4
      for (int c = 0; c < kHalfVecs; ++c) {
        acc[r][c] = _mm512_setzero_ph();
      }
    }
    const int64_t k1 = std::min(K, k0 + kHalfChunk);
    for (int64_t k = k0; k < k1; ++k) {
      __m512h b[kHalfVecs];
#pragma GCC unroll 4
      for (int c = 0; c < kHalfVecs; ++c) {
        b[c] = _mm512_loadu_ph(B + k * kHalfCols + 32 * c);
      }
#pragma GCC unroll 8
      for (int r = 0; r < kHalfRows; ++r) {
        const __m512h a = _mm512_castps_ph(_mm512_set1_ps(*reinterpret_cast<const float*>(P + r * ldp + k)));
#pragma GCC unroll 4
        for (int c = 0; c < kHalfVecs; ++c) {
          acc[r][c] = _mm512_fmadd_ph(a, b[c], acc[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kHalfRows; ++r) {
#pragma GCC unroll 4
      for (int c = 0; c < kHalfVecs; ++c) {
        const __m512i bits = _mm512_castph_si512(acc[r][c]);
        float* out = sums + r * kHalfCols + 32 * c;
        const vf lo = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_castsi512_si256(bits)));
        const vf hi = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_extracti64x4_epi64(bits, 1)));
        store(out, k0 == 0 ? lo : load(out) + lo);
        store(out + 16, k0 == 0 ? hi : load(out + 16) + hi);
      }
    }
  }
}

// Row `src` (K bf16), scaled by 2^e, to fp16 pairs at `dst`; returns 2^-e.
XENC_INLINE float half_row(const BFloat16* src, int64_t K, uint32_t* dst) {
  vf top = zeros();
  for (int64_t c = 0; c < K; c += 16) {
    top = vmax(top, _mm512_abs_ps(load_first(src + c, std::min<int64_t>(16, K - c))));
  }
  const float largest = reduce_max(top);
  int e = 0;
  if (largest > 0.f && std::isfinite(largest)) {
    std::frexp(largest, &e);  // largest < 2^e
    e = std::clamp(kHalfRowMax - e, -126, 126);
  }
  const vf scale = splat(std::ldexp(1.f, e));
  for (int64_t c = 0; c < K; c += 16) {
    const int64_t n = std::min<int64_t>(16, K - c);
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_castph_si256(_mm512_cvtxps_ph(load_first(src + c, n) * scale)));
    _mm512_mask_storeu_epi32(dst + c, first_lanes(n), _mm512_or_si512(h, _mm512_slli_epi32(h, 16)));
  }
  return std::ldexp(1.f, -e);
}

}  // namespace

at::Tensor linear_half(const at::Tensor& x, const at::Tensor& blocks, int64_t weight_exponent, const at::Tensor& bias,
                       int64_t out_features, c10::string_view activation, const std::optional<at::Tensor>& residual) {
  const LinearArgs args =
      check_linear("linear_half", x, at::kBFloat16, blocks, at::kHalf, kHalfCols, bias, out_features, activation,
                   residual);
  const int64_t M = args.M, K = args.K, N = args.N, nblk = args.nblk, res_stride = args.res_stride;
  const bool gelu = args.gelu;
  const BFloat16* res = static_cast<const BFloat16*>(args.res);
  TORCH_CHECK(std::abs(weight_exponent) <= 126, "linear_half's weight exponent must lie in [-126, 126], got ",
              weight_exponent);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) {
    return y;
  }
  const BFloat16* X = x.const_data_ptr<BFloat16>();
  const Half* W = blocks.const_data_ptr<Half>();
  const float* Bias = bias.const_data_ptr<float>();
  BFloat16* Y = y.mutable_data_ptr<BFloat16>();
  const vf weight_undo = splat(std::ldexp(1.f, -static_cast<int>(weight_exponent)));
  const int64_t x_stride = x.stride(0), mblk = (M + kHalfBlockRows - 1) / kHalfBlockRows;
  const int64_t ldp = std::max<int64_t>(K, 1);
  // Blocks in row-major order, so that a thread's consecutive blocks share rows of x (converted once).
  at::parallel_for(0, mblk * nblk, 1, [&](int64_t begin, int64_t end) {
    Scratch panel(kHalfBlockRows * ldp * static_cast<int64_t>(sizeof(uint32_t)));
    Scratch sums_buffer(kHalfRows * kHalfCols * static_cast<int64_t>(sizeof(float)));
    float unscale[kHalfBlockRows];
    uint32_t* P = panel.as<uint32_t>();
    float* sums = sums_buffer.as<float>();
    int64_t converted = -1;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t mi = b / nblk, ni = b % nblk, m0 = mi * kHalfBlockRows, n0 = ni * kHalfCols;
      const int64_t rows = std::min(kHalfBlockRows, M - m0), cols = std::min(kHalfCols, N - n0);
      if (mi != converted) {
        for (int64_t r = 0; r < (rows + kHalfRows - 1) / kHalfRows * kHalfRows; ++r) {
          if (r < rows) {
            unscale[r] = half_row(X + (m0 + r) * x_stride, K, P + r * ldp);
          } else {
            std::fill(P + r * ldp, P + r * ldp + K, 0u);  // the last tile's rows past M
          }
        }
        converted = mi;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kHalfRows) {
        half_tile(P + r0 * ldp, ldp, W + ni * K * kHalfCols, K, sums);
        for (int64_t r = r0; r < std::min(rows, r0 + kHalfRows); ++r) {
          BFloat16* out = Y + (m0 + r) * N + n0;
          const vf undo = splat(unscale[r]);
          for (int64_t c = 0; c < cols; c += 16) {
            const int64_t n = std::min<int64_t>(16, cols - c);
            // sums * 2^-e * 2^-t is exact: one rounding, in adding the bias
            const vf v = fma(load(sums + (r - r0) * kHalfCols + c) * undo, weight_undo, loadu(Bias + n0 + c));
            store_first(out + c, finish(v, gelu, res ? res + (m0 + r) * res_stride + n0 + c : nullptr, n), n);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace xenc_lab
#endif  // XENC_HALF_GEMM
