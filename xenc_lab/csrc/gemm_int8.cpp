// Linear layers in int8 (quantization="int8"): y = dequant(q(x) q(W)^T) + bias, then exact GELU, + residual, or a
// gated layer's silu(gate) * up.
// - W is int8, symmetric, one scale per output channel, quantized once at load (xenc_lab/cpu/int8_math.py).
// - x is quantized here, per row (token), to unsigned bytes with a zero point, with no calibration: the row's range
//   [min(x, 0), max(x, 0)] in 255 steps of s, u = round(x * (1 / s)) + z, z = round(-min / s). A row after a GELU
//   (mostly positive) keeps all 8 bits this way, not 7 (docs/int8.md measures both).
// - The products are ATen's u8 x s8 -> s32 brgemm ukernel (oneDNN: AVX512-VNNI's vpdpbusd or AMX-INT8), or our own
//   on 256-bit registers where ATen's refuses (AVX-VNNI alone, own_products below):
//   the zero point times the column sums sum_k W[n, k] (computed at load) is taken off each int32 sum, which is then
//   exact: sum_k (u[m, k] - z[m]) W[n, k].
// - Epilogue on each row of an output tile while it is in cache, in one pass: sum * (s[m] * scale_w[n]) + bias[n]
//   in fp32, then GELU or the residual, rounded once to x's type (float32, bfloat16 or float16).
// mlp_int8 runs two such layers in a row (an encoder's FFN) a block of rows at a time: the first's output for the
// block stays in cache and is quantized there for the second, to the bit what two linear_int8 calls compute.
// W^T is packed once at load as blocks (N / kInt8Cols, K4 / 4, kInt8Cols, 4) of int8 (K4: K rounded up to 4, the
// VNNI layout: 4 consecutive k of one column side by side), zero-padded. A row's result depends on that row alone.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#include "gemm.h"
#include "norm.h"
#include "ops.h"
#include "vec.h"

#if XENC_GEMM_INT8
namespace xenc_lab {
namespace {

constexpr int64_t kInt8Rows = 96;  // rows of x per block, quantized once into a u8 panel that stays in L2
constexpr int64_t kInt8Cols = 64;  // columns of W^T per block: a 96 x 64 int32 tile, 24 KB, stays in L1

// The rotation of x's rows (``rotation`` = kRotation): each block of kRotation columns times the Sylvester Hadamard
// matrix of that order (entries +-1), by the butterflies of strides 1, 2, ..., 64 in that order, each (a, b) ->
// (a + b, a - b) rounded in fp32, as ``cpu.int8_math.hadamard_rows``. The weights' rows were rotated alike at load, so
// the products are 128 times x W^T (the 1 / 128 is in the weight scales): the rotation spreads a row's outlier
// columns over the block, and the per-row step of the quantization shrinks with the range.
constexpr int64_t kRotation = 128;

#if XENC_AVX512
template <int kStride>
XENC_INLINE vf butterfly_in_register(vf v) {  // strides 1, 2, 4, 8 among a register's 16 lanes
  vf partner;
  __mmask16 second;
  if constexpr (kStride == 1) {
    partner = _mm512_permute_ps(v, 0xB1), second = 0xAAAA;
  } else if constexpr (kStride == 2) {
    partner = _mm512_permute_ps(v, 0x4E), second = 0xCCCC;
  } else if constexpr (kStride == 4) {
    partner = _mm512_shuffle_f32x4(v, v, 0xB1), second = 0xF0F0;
  } else {
    partner = _mm512_shuffle_f32x4(v, v, 0x4E), second = 0xFF00;
  }
  // a + b first, a - b second, as b * 1 + a and b * -1 + a: one fused op, each sum rounded once, as an add's
  const vf sign = _mm512_mask_mov_ps(splat(1.f), second, splat(-1.f));
  return fma(v, sign, partner);
}

XENC_INLINE void hadamard_block(vf v[8]) {
  for (int i = 0; i < 8; ++i) {
    v[i] = butterfly_in_register<4>(butterfly_in_register<2>(butterfly_in_register<1>(v[i])));
    v[i] = butterfly_in_register<8>(v[i]);
  }
  for (int stride = 1; stride < 8; stride *= 2) {  // strides 16, 32, 64: between registers
    for (int i = 0; i < 8; ++i) {
      if (!(i & stride)) {
        const vf a = v[i], b = v[i + stride];
        v[i] = a + b, v[i + stride] = a - b;
      }
    }
  }
}
#else
inline void hadamard_block(float* w) {
  for (int64_t stride = 1; stride < kRotation; stride *= 2) {
    for (int64_t i = 0; i < kRotation; ++i) {
      if (!(i & stride)) {
        const float a = w[i], b = w[i + stride];
        w[i] = a + b, w[i + stride] = a - b;
      }
    }
  }
}
#endif

// Quantizes `rows` rows of x (stride x_stride, K columns), rotated first where `rotate` (K a multiple of
// kRotation), into `panel` (rows x K4 bytes, padded with zeros), their scales into `scales` and zero points into
// `zero_points`; `wide` is a float buffer of K4. As ``cpu.int8_math.quantize_rows``: u = round(x * (1 / s)) + z.
template <typename T>
void quantize_rows(const T* x, int64_t x_stride, int64_t rows, int64_t K, int64_t K4, bool rotate, uint8_t* panel,
                   float* scales, int32_t* zero_points, float* wide) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = x + r * x_stride;
    if (r + 1 < rows) {  // the next row, from memory, arrives while this one is quantized
      const char* next = reinterpret_cast<const char*>(src + x_stride);
      for (int64_t offset = 0; offset < K * static_cast<int64_t>(sizeof(T)); offset += 64) {
        __builtin_prefetch(next + offset);
      }
    }
    vf largest = zeros(), smallest = zeros();  // zero is in every row's range
#if XENC_AVX512
    if (rotate) {
      for (int64_t b = 0; b < K; b += kRotation) {
        vf v[8];
        for (int i = 0; i < 8; ++i) {
          v[i] = load_first(src + b + 16 * i, 16);
        }
        hadamard_block(v);
        for (int i = 0; i < 8; ++i) {
          store(wide + b + 16 * i, v[i]);
          largest = vmax(largest, v[i]);
          smallest = vmin(smallest, v[i]);
        }
      }
    } else {
      for (int64_t c = 0; c < K; c += 16) {
        const vf v = load_first(src + c, std::min<int64_t>(16, K - c));  // lanes past K are zero
        largest = vmax(largest, v);
        smallest = vmin(smallest, v);
      }
    }
#else
    for (int64_t c = 0; c < K; ++c) {
      wide[c] = static_cast<float>(src[c]);
    }
    for (int64_t b = 0; rotate && b < K; b += kRotation) {
      hadamard_block(wide + b);
    }
    for (int64_t c = 0; c < K; c += 16) {
      const vf v = load_first(wide + c, std::min<int64_t>(16, K - c));
      largest = vmax(largest, v);
      smallest = vmin(smallest, v);
    }
#endif
    const float low = reduce_min(smallest), high = reduce_max(largest);
    const float s = std::max((high - low) / 255.f, 1e-30f), inverse = 1.f / s;
    const float z = std::nearbyint(-low / s);
    scales[r] = s;
    zero_points[r] = static_cast<int32_t>(z);
    uint8_t* out = panel + r * K4;
#if XENC_AVX512
    // Rounded to nearest even (the default rounding mode, as torch's round), the zero point added, clamped to
    // [0, 255]: below by a max, above by the unsigned saturating narrowing.
    const __m512i zero_point = _mm512_set1_epi32(static_cast<int32_t>(z));
    int64_t c = 0;
    // 64 columns at a time: four registers of int32 codes narrowed by two saturating packs (which also clamp to
    // [0, 255]) into one register of bytes, whose 128-bit lanes interleave the four: put back in order.
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; c + 64 <= K; c += 64) {
      __m512i q[4];
      for (int i = 0; i < 4; ++i) {
        const vf v = rotate ? load(wide + c + 16 * i) : load_first(src + c + 16 * i, 16);
        q[i] = _mm512_add_epi32(_mm512_cvtps_epi32(v * splat(inverse)), zero_point);
      }
      const __m512i bytes = _mm512_packus_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]));
      _mm512_storeu_si512(out + c, _mm512_permutexvar_epi32(order, bytes));
    }
    for (; c < K; c += 16) {
      const int64_t n = std::min<int64_t>(16, K - c);
      const vf v = rotate ? load(wide + c) : load_first(src + c, n);
      const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v * splat(inverse)), zero_point);
      _mm512_mask_cvtusepi32_storeu_epi8(out + c, first_lanes(n), _mm512_max_epi32(u, _mm512_setzero_si512()));
    }
#else
    for (int64_t c = 0; c < K; ++c) {  // round to nearest even, as torch's round
      out[c] = static_cast<uint8_t>(std::min(std::max(std::nearbyint(wide[c] * inverse) + z, 0.f), 255.f));
    }
#endif
    for (int64_t c = K; c < K4; ++c) {  // padding, against the weights' zero padding
      out[c] = 0;
    }
  }
}

// x * sigmoid(x), with exp(-|x|) <= 1 (no overflow): sigmoid is 1 / (1 + e) for x >= 0 and e / (1 + e) below.
#if XENC_AVX512
XENC_INLINE vf silu(vf x) {
  const vf e = exp2_nonpositive(vandnot(splat(-0.f), x) * splat(-1.4426950408889634f));
  const vf top = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, splat(0.f), _CMP_LT_OQ), x, e);
  return _mm512_div_ps(top, splat(1.f) + e);
}
#endif

// The epilogue of one output row of a tile: the exact int32 sums less the zero point times the column sums, one
// fp32 scale each, the bias, then GELU or the residual; `cols` columns rounded to T. Gated (a gate/up layer packed
// with each tile's 32 gate columns before their 32 up columns): silu(gate) * up, 32 columns to `out`.
template <typename T>
XENC_INLINE void finish_row(const int32_t* acc, int32_t z, const int32_t* sums, float x_scale, const float* w_scale,
                            const float* bias, bool gelu, bool gated, const T* res, int64_t cols, T* out) {
#if XENC_AVX512
  const __m512i zero_point = _mm512_set1_epi32(z);
  const auto value = [&](int64_t c) {
    const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(acc + c),
                                           _mm512_mullo_epi32(zero_point, _mm512_loadu_si512(sums + c)));
    return fma(_mm512_cvtepi32_ps(exact), splat(x_scale) * loadu(w_scale + c), loadu(bias + c));
  };
  if (gated) {
    for (int64_t c = 0; c < kInt8Cols / 2; c += 16) {
      store_first(out + c, silu(value(c)) * value(c + kInt8Cols / 2), 16);
    }
    return;
  }
  const auto column = [&](int64_t c, int64_t n) {
    store_first(out + c, finish(value(c), gelu, res ? res + c : nullptr, n), n);
  };
  if (cols == kInt8Cols) {  // a whole tile, unrolled
    for (int64_t c = 0; c < kInt8Cols; c += 16) {
      column(c, 16);
    }
    return;
  }
  for (int64_t c = 0; c < cols; c += 16) {
    column(c, std::min<int64_t>(16, cols - c));
  }
#else
  alignas(64) float row[kInt8Cols];
  for (int64_t c = 0; c < kInt8Cols; ++c) {  // vectorized by the compiler
    row[c] = static_cast<float>(acc[c] - z * sums[c]) * (x_scale * w_scale[c]) + bias[c];
  }
  if (gated) {
    for (int64_t c = 0; c < kInt8Cols / 2; ++c) {
      const float g = row[c];
      out[c] = static_cast<T>(g / (1.f + std::exp(-g)) * row[c + kInt8Cols / 2]);
    }
    return;
  }
  for (int64_t c = 0; c < cols; c += 16) {
    const int64_t n = std::min<int64_t>(16, cols - c);
    store_first(out + c, finish(load(row + c), gelu, res ? res + c : nullptr, n), n);
  }
#endif
}

// One layer's weight as linear_int8 takes it (packed at load by cpu/int8_math.py), its activation, and its rotation.
struct Int8Layer {
  const int8_t* blocks;
  const int32_t* correction;
  const float* weight_scale;
  const float* bias;
  int64_t K, K4, N, nblk;
  bool gelu, gated;
  int64_t rotation;
  int64_t width_out() const { return gated ? N / 2 : N; }  // columns of y
};

Int8Layer int8_layer(int64_t K, const at::Tensor& blocks, const at::Tensor& correction, const at::Tensor& weight_scale,
                     const at::Tensor& bias, int64_t out_features, c10::string_view activation, int64_t rotation) {
  const int64_t K4 = (K + 3) / 4 * 4, N = out_features;
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
  TORCH_CHECK(rotation == 0 || (rotation == kRotation && K % kRotation == 0),
              "linear_int8 rotates blocks of ", kRotation, " columns of x, or none (0), got ", rotation, " for K = ",
              K);
  const bool gelu = activation == "gelu", gated = activation == "silu_mul";
  TORCH_CHECK(gelu || gated || activation == "none",
              "linear_int8's activation is \"none\", \"gelu\" or \"silu_mul\", got ", activation);
  TORCH_CHECK(!gated || N % kInt8Cols == 0, "linear_int8's silu_mul takes a gate/up layer of whole ", kInt8Cols,
              "-column blocks, got ", N, " columns");
  return {blocks.const_data_ptr<int8_t>(), correction.const_data_ptr<int32_t>(), weight_scale.const_data_ptr<float>(),
          bias.const_data_ptr<float>(), K, K4, N, nblk, gelu, gated, rotation};
}

// The residual of a layer with N columns and M rows of type T, checked: its data and row stride (nullptr, 0: none).
template <typename T>
std::pair<const T*, int64_t> residual_of(const std::optional<at::Tensor>& residual, int64_t M, int64_t N) {
  if (!residual.has_value()) {
    return {nullptr, 0};
  }
  const at::Tensor& r = *residual;
  const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(r.dim() == 2 && r.size(0) == M && r.size(1) == N && r.scalar_type() == dtype &&
                  (N <= 1 || r.stride(1) == 1),
              "linear_int8's residual must be a ", dtype, " (", M, ", ", N, ") tensor with contiguous columns");
  return {r.const_data_ptr<T>(), r.stride(0)};
}

// What one thread holds for a block of rows: the quantized panel with its scales and zero points, a float row for
// the rotation, and the int32 tile.
struct RowBlock {
  Scratch panel, wide, tile;
  float scales[kInt8Rows];
  int32_t zero_points[kInt8Rows];
  explicit RowBlock(int64_t K4)
      : panel(kInt8Rows * K4),
        wide(K4 * static_cast<int64_t>(sizeof(float))),
        tile(kInt8Rows * kInt8Cols * static_cast<int64_t>(sizeof(int32_t))) {}
  template <typename T>
  void quantize(const Int8Layer& layer, const T* x, int64_t x_stride, int64_t rows) {
    quantize_rows(x, x_stride, rows, layer.K, layer.K4, layer.rotation != 0, panel.as<uint8_t>(), scales, zero_points,
                  wide.as<float>());
  }
};

// M rows cut into blocks of at most kInt8Rows, as many blocks per thread, their sizes within one row of each other,
// so that no thread is left a block more than the others (M = 4096 in blocks of 96 did that). Blocks of at least 8
// rows where M allows, each of which reads all of a layer's weights.
struct RowBlocks {
  int64_t M, count;
  RowBlocks(int64_t rows, int64_t threads) : M(rows) {
    const int64_t per_thread = (rows + threads * kInt8Rows - 1) / (threads * kInt8Rows);
    count = std::max<int64_t>(1, std::min(threads * per_thread, (rows + 7) / 8));
  }
  int64_t start(int64_t i) const { return i * M / count; }
  int64_t rows(int64_t i) const { return start(i + 1) - start(i); }
};

// Products of our own, C (rows x kInt8Cols int32, row stride kInt8Cols) = A (rows x K4 u8, row stride K4) times one
// block of W^T (K4 / 4 groups of kInt8Cols x 4 s8: the VNNI layout), on 256-bit registers: AVX-VNNI's vpdpbusd, or
// AVX512-VNNI's on 256-bit registers where the build has that. They run where ATen's brgemm does not (it asks oneDNN
// for AVX512-VNNI or AMX: Intel's client cores since Alder Lake and its E-core Xeons have AVX-VNNI alone), chosen by
// int8_own_products(). The sums are exact int32, so they equal the brgemm's to the bit.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define XENC_OWN_VNNI 1
XENC_INLINE __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, a, b);
#else
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#endif
}

// R rows (at most 6) by 16 columns at a time: 2R accumulators, 2 registers of W^T and one of x, within AVX2's 16.
template <int R>
XENC_INLINE void own_product_rows(const uint8_t* A, int64_t K4, const int8_t* B, int32_t* C) {
  const int64_t groups = K4 / 4;
  for (int64_t c0 = 0; c0 < kInt8Cols; c0 += 16) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    }
    const int8_t* b = B + c0 * 4;
    for (int64_t g = 0; g < groups; ++g, b += kInt8Cols * 4) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
      for (int r = 0; r < R; ++r) {
        int32_t quad;  // row r's 4 codes of group g
        std::memcpy(&quad, A + r * K4 + 4 * g, sizeof(quad));
        const __m256i a = _mm256_set1_epi32(quad);
        acc[r][0] = dpbusd(acc[r][0], a, b0);
        acc[r][1] = dpbusd(acc[r][1], a, b1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * kInt8Cols + c0), acc[r][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * kInt8Cols + c0 + 8), acc[r][1]);
    }
  }
}

void own_products(int64_t rows, int64_t K4, const uint8_t* A, const int8_t* B, int32_t* C) {
  constexpr int kRows = 6;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    own_product_rows<kRows>(A + r * K4, K4, B, C + r * kInt8Cols);
  }
  if (r < rows) {
    with_count<kRows - 1>(rows - r, [&](auto count) { own_product_rows<count()>(A + r * K4, K4, B, C + r * kInt8Cols); });
  }
}
#else
#define XENC_OWN_VNNI 0
#endif

// Whether the products are our own (above) rather than ATen's brgemm: set by int8_own_products() before any call.
std::atomic<bool> own_products_chosen{false};

// Runs body(block, buffer, mi) for each row block mi of `rows` on the intra-op threads, each thread with a RowBlock
// (`K4`) and a buffer of `floats` of its own, made once: a block goes to whichever thread comes free first, so that a
// thread slowed by other work on its core takes fewer blocks instead of keeping the others waiting at the end. A
// row's result is the same on any thread.
template <typename Body>
void for_each_row_block(const RowBlocks& rows, int64_t K4, int64_t floats, Body body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), rows.count), 1, [&](int64_t, int64_t) {
    RowBlock block(K4);
    Scratch buffer(floats * static_cast<int64_t>(sizeof(float)));
    for (int64_t mi = next.fetch_add(1, std::memory_order_relaxed); mi < rows.count;
         mi = next.fetch_add(1, std::memory_order_relaxed)) {
      body(block, buffer.as<float>(), mi);
    }
    at::native::cpublas::brgemm_release(true);
  });
}

// The LayerNorm a layer ends in, where given (norm_weight and norm_bias of x's type, out_features each): checked.
template <typename T>
std::optional<NormAffine> norm_of(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  int64_t N, double eps) {
  TORCH_CHECK(weight.has_value() == bias.has_value(),
              "int8 layers end in a LayerNorm with both weight and bias, or none");
  if (!weight.has_value()) {
    return std::nullopt;
  }
  const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  for (const at::Tensor* t : {&*weight, &*bias}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == N && t->is_contiguous() && t->scalar_type() == dtype,
                "the LayerNorm's weight and bias must be contiguous (", N, ",) ", dtype, " tensors, got ",
                t->scalar_type(), " ", t->sizes());
  }
  return std::optional<NormAffine>(std::in_place, weight->const_data_ptr<T>(), bias->const_data_ptr<T>(), N,
                                   static_cast<float>(eps));
}

// LayerNorm in place on `rows` finished rows of y (row stride y_stride), as the layer_norm op computes it, while they
// are in cache; `buffer` holds kNormRows x norm.width floats.
template <typename T>
void normalize_block(const NormAffine& norm, T* y, int64_t y_stride, int64_t rows, float* buffer) {
  for (int64_t r = 0; r < rows; r += kNormRows) {
    layer_norm_group(y + r * y_stride, y_stride, norm, y + r * y_stride, y_stride, std::min(kNormRows, rows - r),
                     buffer);
  }
}

// Column block ni of `layer` on the quantized rows of `block`: the products, then the epilogue into `out` (row stride
// out_stride; its column ni * kInt8Cols, or half that for a gated layer), with the residual `res` (row stride
// res_stride) added where given.
template <typename T>
void int8_tile(const Int8Layer& layer, int64_t ni, RowBlock& block, int64_t rows, T* out, int64_t out_stride,
               const T* res, int64_t res_stride) {
  const int64_t n0 = ni * kInt8Cols, cols = std::min(kInt8Cols, layer.N - n0);
  if (res) {  // the tile's residual, read from memory, arrives while the products run
    for (int64_t r = 0; r < rows; ++r) {
      const char* line = reinterpret_cast<const char*>(res + r * res_stride + n0);
      for (int64_t offset = 0; offset < cols * static_cast<int64_t>(sizeof(T)); offset += 64) {
        __builtin_prefetch(line + offset);
      }
    }
  }
  int32_t* C = block.tile.as<int32_t>();
  const int8_t* B = layer.blocks + ni * layer.K4 * kInt8Cols;
#if XENC_OWN_VNNI
  if (own_products_chosen.load(std::memory_order_relaxed)) {
    own_products(rows, layer.K4, block.panel.as<uint8_t>(), B, C);
  } else
#endif
  {
    at::native::cpublas::brgemm(rows, kInt8Cols, layer.K4, layer.K4, kInt8Cols, kInt8Cols, false,
                                block.panel.as<uint8_t>(), B, C, true);
  }
  T* first = out + (layer.gated ? n0 / 2 : n0);
  for (int64_t r = 0; r < rows; ++r) {
    finish_row(C + r * kInt8Cols, block.zero_points[r], layer.correction + n0, block.scales[r],
               layer.weight_scale + n0, layer.bias + n0, layer.gelu, layer.gated,
               res ? res + r * res_stride + n0 : nullptr, cols, first + r * out_stride);
  }
}

// Every column block of `layer` on the quantized rows of `block` (int8_tile), then, where `norm` is given, their
// LayerNorm in place while the rows are in cache (`buffer`: kNormRows x norm->width floats).
template <typename T>
void int8_block(const Int8Layer& layer, RowBlock& block, int64_t rows, T* out, int64_t out_stride, const T* res,
                int64_t res_stride, const NormAffine* norm, float* buffer) {
  for (int64_t ni = 0; ni < layer.nblk; ++ni) {
    int8_tile(layer, ni, block, rows, out, out_stride, res, res_stride);
  }
  if (norm) {
    normalize_block(*norm, out, out_stride, rows, buffer);
  }
}

template <typename T>
at::Tensor linear_int8_on(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& correction,
                          const at::Tensor& weight_scale, const at::Tensor& bias, int64_t out_features,
                          c10::string_view activation, const std::optional<at::Tensor>& residual, int64_t rotation,
                          const std::optional<at::Tensor>& norm_weight, const std::optional<at::Tensor>& norm_bias,
                          double norm_eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "linear_int8 takes a 2-D CPU tensor, got shape ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K <= 1 || x.stride(1) == 1, "linear_int8 needs contiguous columns, got strides ", x.strides());
  const Int8Layer layer = int8_layer(K, blocks, correction, weight_scale, bias, out_features, activation, rotation);
  TORCH_CHECK(!residual.has_value() || !(layer.gelu || layer.gated),
              "linear_int8 adds a residual to the plain product only");
  const auto [res, res_stride] = residual_of<T>(residual, M, layer.N);
  const int64_t width_out = layer.width_out();
  const std::optional<NormAffine> norm = norm_of<T>(norm_weight, norm_bias, width_out, norm_eps);
  at::Tensor y = at::empty({M, width_out}, x.options());
  if (M == 0) {
    return y;
  }
  const T* X = x.const_data_ptr<T>();
  T* Y = y.mutable_data_ptr<T>();
  const RowBlocks blocks_of_rows(M, at::get_num_threads());
  const int64_t x_stride = x.stride(0), nblk = layer.nblk;
  // A block of rows at a time: all its columns, then its LayerNorm where there is one, while it is in cache. Where
  // there are too few blocks to go round, tiles instead (below).
  if (norm || blocks_of_rows.count >= 2 * at::get_num_threads()) {
    for_each_row_block(blocks_of_rows, layer.K4, norm ? kNormRows * norm->width : 0,
                       [&](RowBlock& block, float* buffer, int64_t mi) {
      const int64_t m0 = blocks_of_rows.start(mi), rows = blocks_of_rows.rows(mi);
      block.quantize(layer, X + m0 * x_stride, x_stride, rows);
      int8_block(layer, block, rows, Y + m0 * width_out, width_out, res ? res + m0 * res_stride : nullptr,
                 res_stride, norm ? &*norm : nullptr, buffer);
    });
    return y;
  }
  // Too few blocks to go round: tiles in row-major order, so that a thread's consecutive tiles share rows of x
  // (quantized once).
  at::parallel_for(0, blocks_of_rows.count * nblk, 1, [&](int64_t begin, int64_t end) {
    RowBlock block(layer.K4);
    int64_t quantized = -1;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t mi = b / nblk, m0 = blocks_of_rows.start(mi), rows = blocks_of_rows.rows(mi);
      if (mi != quantized) {
        block.quantize(layer, X + m0 * x_stride, x_stride, rows);
        quantized = mi;
      }
      int8_tile(layer, b % nblk, block, rows, Y + m0 * width_out, width_out, res ? res + m0 * res_stride : nullptr,
                res_stride);
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

// Two int8 layers in a row, y = second(first(x)) + residual, a block of rows at a time: first's output for the block
// (GELU or silu(gate) * up) stays in this thread's cache, rounded to T, and is quantized there for second, whose
// rows are then finished. Each row computes what linear_int8 computes layer by layer, to the bit; only the
// intermediate's trip through memory is gone.
template <typename T>
at::Tensor mlp_int8_on(const at::Tensor& x, const Int8Layer& first, const Int8Layer& second,
                       const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& norm_weight,
                       const std::optional<at::Tensor>& norm_bias, double norm_eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "mlp_int8 takes a 2-D CPU tensor, got shape ", x.sizes());
  const int64_t M = x.size(0), hidden = first.width_out();
  TORCH_CHECK(x.size(1) == first.K && (first.K <= 1 || x.stride(1) == 1), "mlp_int8 takes x of ", first.K,
              " contiguous columns, got shape ", x.sizes(), " and strides ", x.strides());
  TORCH_CHECK(second.K == hidden && !second.gelu && !second.gated, "mlp_int8's second layer takes the first's ",
              hidden, " columns, plain, got ", second.K);
  const auto [res, res_stride] = residual_of<T>(residual, M, second.N);
  const std::optional<NormAffine> norm = norm_of<T>(norm_weight, norm_bias, second.N, norm_eps);
  at::Tensor y = at::empty({M, second.N}, x.options());
  if (M == 0) {
    return y;
  }
  const T* X = x.const_data_ptr<T>();
  T* Y = y.mutable_data_ptr<T>();
  const RowBlocks blocks_of_rows(M, at::get_num_threads());
  const int64_t x_stride = x.stride(0);
  // The buffer holds the intermediate's rows (as T), then the LayerNorm's floats.
  const int64_t between = round_up(kInt8Rows * hidden * static_cast<int64_t>(sizeof(T)), 64) /
                          static_cast<int64_t>(sizeof(float));
  // One panel serves both layers in turn: the first's codes are spent when the intermediate is quantized.
  for_each_row_block(blocks_of_rows, std::max(first.K4, second.K4), between + (norm ? kNormRows * norm->width : 0),
                     [&](RowBlock& block, float* buffer, int64_t mi) {
    T* H = reinterpret_cast<T*>(buffer);
    const int64_t m0 = blocks_of_rows.start(mi), rows = blocks_of_rows.rows(mi);
    block.quantize(first, X + m0 * x_stride, x_stride, rows);
    int8_block<T>(first, block, rows, H, hidden, nullptr, 0, nullptr, nullptr);
    block.quantize(second, H, hidden, rows);
    int8_block(second, block, rows, Y + m0 * second.N, second.N, res ? res + m0 * res_stride : nullptr, res_stride,
               norm ? &*norm : nullptr, buffer + between);
  });
  return y;
}

}  // namespace

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& correction,
                       const at::Tensor& weight_scale, const at::Tensor& bias, int64_t out_features,
                       c10::string_view activation, const std::optional<at::Tensor>& residual, int64_t rotation,
                       const std::optional<at::Tensor>& norm_weight, const std::optional<at::Tensor>& norm_bias,
                       double norm_eps) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return linear_int8_on<float>(x, blocks, correction, weight_scale, bias, out_features, activation, residual,
                                   rotation, norm_weight, norm_bias, norm_eps);
    case at::kBFloat16:
      return linear_int8_on<BFloat16>(x, blocks, correction, weight_scale, bias, out_features, activation, residual,
                                      rotation, norm_weight, norm_bias, norm_eps);
    case at::kHalf:
      return linear_int8_on<Half>(x, blocks, correction, weight_scale, bias, out_features, activation, residual,
                                  rotation, norm_weight, norm_bias, norm_eps);
    default:
      TORCH_CHECK(false, "linear_int8 takes float32, bfloat16 or float16 x, got ", x.scalar_type());
  }
}

at::Tensor mlp_int8(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& correction,
                    const at::Tensor& weight_scale, const at::Tensor& bias, int64_t hidden_features,
                    c10::string_view activation, int64_t rotation, const at::Tensor& blocks2,
                    const at::Tensor& correction2, const at::Tensor& weight_scale2, const at::Tensor& bias2,
                    int64_t out_features, const std::optional<at::Tensor>& residual, int64_t rotation2,
                    const std::optional<at::Tensor>& norm_weight, const std::optional<at::Tensor>& norm_bias,
                    double norm_eps) {
  TORCH_CHECK(x.dim() == 2, "mlp_int8 takes a 2-D tensor, got shape ", x.sizes());
  const Int8Layer first =
      int8_layer(x.size(1), blocks, correction, weight_scale, bias, hidden_features, activation, rotation);
  const Int8Layer second = int8_layer(first.width_out(), blocks2, correction2, weight_scale2, bias2, out_features,
                                      "none", rotation2);
  switch (x.scalar_type()) {
    case at::kFloat:
      return mlp_int8_on<float>(x, first, second, residual, norm_weight, norm_bias, norm_eps);
    case at::kBFloat16:
      return mlp_int8_on<BFloat16>(x, first, second, residual, norm_weight, norm_bias, norm_eps);
    case at::kHalf:
      return mlp_int8_on<Half>(x, first, second, residual, norm_weight, norm_bias, norm_eps);
    default:
      TORCH_CHECK(false, "mlp_int8 takes float32, bfloat16 or float16 x, got ", x.scalar_type());
  }
}

bool int8_own_products(bool on) {
  own_products_chosen.store(on && XENC_OWN_VNNI, std::memory_order_relaxed);
  return XENC_OWN_VNNI;
}

}  // namespace xenc_lab
#endif  // XENC_GEMM_INT8
