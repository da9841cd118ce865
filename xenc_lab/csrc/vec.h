// The vector layer the kernels are written on, and what every op's file shares: the build's feature macros (which
// instruction sets and which of ATen's GEMM ukernels this build has), 16-lane fp32 vectors with their loads, stores,
// 16-bit conversions, exp2, transpose and reductions, and small helpers (lane masks, dispatch on a count, aligned
// scratch buffers).
//
// The kernels are written once over 16-lane fp32 vectors: AVX-512 intrinsics on x86 with AVX512F/BW/VL, GCC/Clang
// generic vectors elsewhere (which the compiler maps onto AVX2, SSE, NEON, ...).
#pragma once

#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define XENC_AVX512 1
#else
#define XENC_AVX512 0
#endif
#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && XENC_AVX512
#define XENC_BF16_DOT 1
#else
#define XENC_BF16_DOT 0
#endif

// The tile path needs ATen's batch-reduce GEMM (oneDNN's brgemm ukernel), which runs on AMX tiles where the CPU
// has them and on AVX-512 dot products elsewhere; without AVX-512 it is not built. Its fp32 GEMM runs on AVX2 too.
#if (XENC_AVX512 || (defined(__AVX2__) && defined(__FMA__))) && __has_include(<ATen/native/CPUBlas.h>)
#include <ATen/native/CPUBlas.h>
#endif
#if XENC_AVX512 && defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32)
#define XENC_TILES 1
#else
#define XENC_TILES 0
#endif
// The fp32 GEMMs of linear layers (linear_f32 for float32 layers with the exact GELU, linear_widened for bf16 and
// fp16 layers, gemm_f32.cpp) run ATen's fp32 brgemm ukernel, on AVX2 or AVX-512.
#if (XENC_AVX512 || (defined(__AVX2__) && defined(__FMA__))) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define XENC_GEMM_F32 1
#else
#define XENC_GEMM_F32 0
#endif

// The bf16 linear layers' fp16 GEMM (linear_half, gemm_half.cpp) needs AVX512-FP16 (fp16 FMAs on 32 lanes).
// The int8 GEMM (gemm_int8.cpp): ATen's u8 x s8 -> s32 brgemm, and the fp32 GEMMs' epilogue.
#if XENC_GEMM_F32 && defined(CPUBLAS_BRGEMM_U8I8I32)
#define XENC_GEMM_INT8 1
#else
#define XENC_GEMM_INT8 0
#endif

#if XENC_AVX512 && XENC_GEMM_F32 && defined(__AVX512FP16__)
#define XENC_HALF_GEMM 1
#else
#define XENC_HALF_GEMM 0
#endif

#if !defined(__GNUC__)
#error "the xenc_lab kernels need GCC or Clang (vector extensions, __builtin_prefetch)"
#endif
#define XENC_INLINE inline __attribute__((always_inline))

namespace xenc_lab {

using c10::BFloat16;
using c10::Half;

// ---------------------------------------------------------------------------------------------------------------
// 16-lane fp32 vectors. Masks select lanes by the low 16 bits of a uint32_t.

#if XENC_AVX512
using vf = __m512;

XENC_INLINE vf zeros() { return _mm512_setzero_ps(); }
XENC_INLINE vf splat(float x) { return _mm512_set1_ps(x); }
XENC_INLINE vf load(const float* p) { return _mm512_load_ps(p); }  // p 64-byte aligned
XENC_INLINE vf loadu(const float* p) { return _mm512_loadu_ps(p); }
XENC_INLINE void store(float* p, vf x) { _mm512_store_ps(p, x); }  // p 64-byte aligned
XENC_INLINE vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
XENC_INLINE vf fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
XENC_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
XENC_INLINE vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
XENC_INLINE vf vand(vf a, vf b) { return _mm512_and_ps(a, b); }
XENC_INLINE vf vandnot(vf a, vf b) { return _mm512_andnot_ps(a, b); }  // ~a & b
XENC_INLINE vf vor(vf a, vf b) { return _mm512_or_ps(a, b); }
XENC_INLINE vf recip_estimate(vf d) { return _mm512_rcp14_ps(d); }  // 1 / d to 14 bits
XENC_INLINE float reduce_max(vf x) { return _mm512_reduce_max_ps(x); }
XENC_INLINE float reduce_min(vf x) { return _mm512_reduce_min_ps(x); }
XENC_INLINE float reduce_add(vf x) { return _mm512_reduce_add_ps(x); }
XENC_INLINE vf keep_lanes(vf x, uint32_t mask, float fill) {  // x on the lanes of mask, fill elsewhere
  return _mm512_mask_mov_ps(_mm512_set1_ps(fill), static_cast<__mmask16>(mask), x);
}

XENC_INLINE __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// Lanes [0, n) from p (n in 0..16), zero elsewhere; reads nothing past p + n.
XENC_INLINE vf load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
XENC_INLINE vf load_first(const BFloat16* p, int64_t n) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first_lanes(n), p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

XENC_INLINE vf load_first(const Half* p, int64_t n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(n), p));
}

// Lanes [0, n) of x to p; 16-bit types rounded to nearest even, as c10's conversions do.
XENC_INLINE void store_first(float* p, vf x, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), x); }
XENC_INLINE void store_first(Half* p, vf x, int64_t n) {
  _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// x's 16 BFloat16 values (rounded to nearest even, NaN made quiet), as 16-bit lanes.
XENC_INLINE __m256i bf16_bits(vf x) {
#if XENC_BF16_DOT
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
XENC_INLINE void store_first(BFloat16* p, vf x, int64_t n) {
  _mm256_mask_storeu_epi16(p, first_lanes(n), bf16_bits(x));
}

// x as a BFloat16 or Half holds it, widened back, in registers: the bits store_first writes and load_first reads.
XENC_INLINE vf narrowed_bf16(vf x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(x)), 16));
}
XENC_INLINE vf narrowed_half(vf x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// 2^x for x <= 0: x = n + f with |f| <= 1/2, 2^f by the Cephes exp2f polynomial (relative error ~2e-7), 2^n by
// vscalefps. Below -125 (-inf included) the result is 0: no lane computes a subnormal or underflowing value,
// each of which costs a microcode assist on Intel cores (masked key lanes, at -inf, would do so on every row of
// scores). Such a term is < 2^-125 of the row's largest, which is 1.
XENC_INLINE vf exp2_nonpositive(vf x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.f));
  const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = x - n;
  vf p = splat(1.535336188319500e-4f);
  p = fma(p, f, splat(1.339887440266574e-3f));
  p = fma(p, f, splat(9.618437357674640e-3f));
  p = fma(p, f, splat(5.550332471162809e-2f));
  p = fma(p, f, splat(2.402264791363012e-1f));
  p = fma(p, f, splat(6.931472028550421e-1f));
  p = fma(p, f, splat(1.f));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

// In-place transpose of a 16x16 matrix of 32-bit elements held in 16 registers.
XENC_INLINE void transpose16(vf r[16]) {
  vf t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: t[i] = a0 b0 a1 b1, t[i+1] = a2 b2 a3 b3
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // per lane L: r[i + c] = column 4L + c of rows i..i+3
    const __m512d t0 = _mm512_castps_pd(t[i]), t1 = _mm512_castps_pd(t[i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[i + 2]), t3 = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of the four row groups g into column 4L + c
    const vf a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);  // g0.L0 g0.L2 g1.L0 g1.L2
    const vf b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);  // g0.L1 g0.L3 g1.L1 g1.L3
    const vf e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const vf f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_f32x4(a, e, 0x88);
    t[8 + c] = _mm512_shuffle_f32x4(a, e, 0xDD);
    t[4 + c] = _mm512_shuffle_f32x4(b, f, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(b, f, 0xDD);
  }
  for (int i = 0; i < 16; ++i) {
    r[i] = t[i];
  }
}

#else  // generic vectors
// 16 lanes as 16 / kLanes native vectors of GCC/Clang's generic vector type, which the compiler maps onto the
// target's SIMD registers (AVX: 8 floats, SSE and NEON: 4).
// Everything here is inlined: GCC's note that vector arguments' ABI depends on the ISA does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#if defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int kParts = 16 / kLanes;

using nf = float __attribute__((vector_size(4 * kLanes)));
using ni = int32_t __attribute__((vector_size(4 * kLanes)));
using nu = uint32_t __attribute__((vector_size(4 * kLanes)));
struct vf {
  nf part[kParts];
};

#define XENC_PARTWISE(expr) \
  vf r;                     \
  for (int i = 0; i < kParts; ++i) r.part[i] = (expr); \
  return r

XENC_INLINE vf operator+(vf a, vf b) { XENC_PARTWISE(a.part[i] + b.part[i]); }
XENC_INLINE vf operator-(vf a, vf b) { XENC_PARTWISE(a.part[i] - b.part[i]); }
XENC_INLINE vf operator*(vf a, vf b) { XENC_PARTWISE(a.part[i] * b.part[i]); }
XENC_INLINE vf fma(vf a, vf b, vf c) { XENC_PARTWISE(a.part[i] * b.part[i] + c.part[i]); }  // contracted to FMA
XENC_INLINE vf fnma(vf a, vf b, vf c) { XENC_PARTWISE(c.part[i] - a.part[i] * b.part[i]); }  // contracted to FNMA
XENC_INLINE vf vand(vf a, vf b) { XENC_PARTWISE((nf)((ni)a.part[i] & (ni)b.part[i])); }
XENC_INLINE vf vandnot(vf a, vf b) { XENC_PARTWISE((nf)(~(ni)a.part[i] & (ni)b.part[i])); }  // ~a & b
XENC_INLINE vf vor(vf a, vf b) { XENC_PARTWISE((nf)((ni)a.part[i] | (ni)b.part[i])); }
XENC_INLINE nf recip_part(nf d) {  // 1 / d to 12 bits where the CPU has an estimate, else exactly
#if defined(__AVX__)
  return _mm256_rcp_ps(d);
#else
  return 1.f / d;
#endif
}
XENC_INLINE vf recip_estimate(vf d) { XENC_PARTWISE(recip_part(d.part[i])); }
XENC_INLINE vf zeros() { return vf{}; }
XENC_INLINE nf broadcast(float x) {  // spelled out: GCC builds a vector filled lane by lane with inserts
#if defined(__AVX__)
  return nf{x, x, x, x, x, x, x, x};
#else
  return nf{x, x, x, x};
#endif
}
XENC_INLINE vf splat(float x) { XENC_PARTWISE(broadcast(x)); }
XENC_INLINE nf select(ni mask, nf a, nf b) { return (nf)(((ni)a & mask) | ((ni)b & ~mask)); }
XENC_INLINE vf vmax(vf a, vf b) { XENC_PARTWISE(select(a.part[i] > b.part[i], a.part[i], b.part[i])); }
XENC_INLINE vf vmin(vf a, vf b) { XENC_PARTWISE(select(a.part[i] < b.part[i], a.part[i], b.part[i])); }
XENC_INLINE vf keep_lanes(vf x, uint32_t mask, float fill) {
  ni lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  XENC_PARTWISE(select(((ni{} + static_cast<int32_t>(mask >> (i * kLanes))) >> lane & 1) != 0, x.part[i],
                       broadcast(fill)));
}

XENC_INLINE float reduce_max(vf x) {
  float r = x.part[0][0];
  for (int i = 0; i < kParts; ++i)
    for (int l = 0; l < kLanes; ++l) r = std::max(r, x.part[i][l]);
  return r;
}
XENC_INLINE float reduce_min(vf x) {
  float r = x.part[0][0];
  for (int i = 0; i < kParts; ++i)
    for (int l = 0; l < kLanes; ++l) r = std::min(r, x.part[i][l]);
  return r;
}
XENC_INLINE float reduce_add(vf x) {
  nf s = x.part[0];
  for (int i = 1; i < kParts; ++i) s += x.part[i];
  float r = 0.f;
  for (int l = 0; l < kLanes; ++l) r += s[l];
  return r;
}

XENC_INLINE nf load_part(const float* p) {
  nf x;
  std::memcpy(&x, p, sizeof(nf));
  return x;
}
XENC_INLINE vf loadu(const float* p) { XENC_PARTWISE(load_part(p + i * kLanes)); }
XENC_INLINE vf load(const float* p) { return loadu(p); }
XENC_INLINE void store(float* p, vf x) {
  for (int i = 0; i < kParts; ++i) std::memcpy(p + i * kLanes, &x.part[i], sizeof(nf));
}

XENC_INLINE vf load_first(const float* p, int64_t n) {
  if (n == 16) return loadu(p);
  float t[16] = {};
  std::memcpy(t, p, n * sizeof(float));
  return loadu(t);
}
// kLanes 16-bit floats widened to fp32, and fp32 rounded to nearest even into them, as c10's conversions do: bf16
// by shifts and integer adds, fp16 by F16C where the CPU has it (else c10's scalar conversions).
using nh = uint16_t __attribute__((vector_size(2 * kLanes)));
XENC_INLINE nf widen_part(const BFloat16* p) {
  nh h;
  std::memcpy(&h, p, sizeof(nh));
  return (nf)(__builtin_convertvector(h, nu) << 16);
}
XENC_INLINE void narrow_part(BFloat16* p, nf x) {
  const nu bits = (nu)x;
  const ni nan = x != x;  // NaN rounds to c10's quiet NaN, 0x7FC0
  const nu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const nh h = __builtin_convertvector((nu)(((ni)rounded & ~nan) | (nan & 0x7FC0)), nh);
  std::memcpy(p, &h, sizeof(nh));
}
#if defined(__F16C__) && defined(__AVX__)
XENC_INLINE nf widen_part(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
XENC_INLINE void narrow_part(Half* p, nf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
XENC_INLINE nf widen_part(const Half* p) {
  nf x;
  for (int l = 0; l < kLanes; ++l) x[l] = static_cast<float>(p[l]);
  return x;
}
XENC_INLINE void narrow_part(Half* p, nf x) {
  for (int l = 0; l < kLanes; ++l) p[l] = static_cast<Half>(x[l]);
}
#endif

template <typename T>  // BFloat16, Half
XENC_INLINE vf load_first(const T* p, int64_t n) {
  if (n == 16) {
    XENC_PARTWISE(widen_part(p + i * kLanes));
  }
  float t[16] = {};
  for (int64_t l = 0; l < n; ++l) t[l] = static_cast<float>(p[l]);
  return loadu(t);
}
XENC_INLINE void store_first(float* p, vf x, int64_t n) { std::memcpy(p, &x, n * sizeof(float)); }
template <typename T>  // BFloat16, Half
XENC_INLINE void store_first(T* p, vf x, int64_t n) {
  if (n == 16) {
    for (int i = 0; i < kParts; ++i) narrow_part(p + i * kLanes, x.part[i]);
    return;
  }
  float t[16];
  store(t, x);
  for (int64_t l = 0; l < n; ++l) p[l] = static_cast<T>(t[l]);
}

// 2^x for x <= 0 (below -125, -inf included, 0: no subnormals, as in the AVX-512 version): x = n + f with
// |f| <= 1/2, 2^f by the Cephes exp2f polynomial (relative error ~2e-7), times 2^n by adding n to its exponent
// bits (exact, the same bits as a multiply by 2^n: 2^f * 2^n stays normal for n >= -125). A lane below -125 is
// not clamped first: whatever its n, f and polynomial come to (NaN at -inf), the mask at the end makes it 0.
// Each step runs on every part before the next step, so that the parts' dependency chains interleave; one chain
// after the other fills the scheduler with waiting instructions.
XENC_INLINE vf exp2_nonpositive(vf x) {
  const nf round = broadcast(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer, kept in the low bits
  ni normal[kParts];
  nf shifted[kParts], f[kParts], p[kParts];
  for (int i = 0; i < kParts; ++i) normal[i] = x.part[i] >= -125.f;
  for (int i = 0; i < kParts; ++i) shifted[i] = x.part[i] + round;
  for (int i = 0; i < kParts; ++i) f[i] = x.part[i] - (shifted[i] - round);
  for (int i = 0; i < kParts; ++i) p[i] = broadcast(1.535336188319500e-4f) * f[i] + 1.339887440266574e-3f;
  for (int i = 0; i < kParts; ++i) p[i] = p[i] * f[i] + 9.618437357674640e-3f;
  for (int i = 0; i < kParts; ++i) p[i] = p[i] * f[i] + 5.550332471162809e-2f;
  for (int i = 0; i < kParts; ++i) p[i] = p[i] * f[i] + 2.402264791363012e-1f;
  for (int i = 0; i < kParts; ++i) p[i] = p[i] * f[i] + 6.931472028550421e-1f;
  for (int i = 0; i < kParts; ++i) p[i] = p[i] * f[i] + 1.f;
  vf r;
  for (int i = 0; i < kParts; ++i) {
    const nu scaled = (nu)p[i] + (((nu)shifted[i] - (nu)round) << 23);  // 2^f * 2^n, wrapping where masked
    r.part[i] = (nf)(scaled & (nu)normal[i]);
  }
  return r;
}
#undef XENC_PARTWISE

XENC_INLINE void transpose16(vf r[16]) {
  float t[16][16];
  for (int i = 0; i < 16; ++i) store(t[i], r[i]);
  for (int i = 0; i < 16; ++i) {
    float c[16];
    for (int j = 0; j < 16; ++j) c[j] = t[j][i];
    r[i] = loadu(c);
  }
}
#endif  // XENC_AVX512

// Lanes l of 16 with a <= l < b.
XENC_INLINE uint32_t lane_range(int64_t a, int64_t b) {
  a = std::clamp<int64_t>(a, 0, 16);
  b = std::clamp<int64_t>(b, 0, 16);
  return ((1u << b) - 1u) & ~((1u << a) - 1u);
}

// Calls f(std::integral_constant<int, n>) for a runtime n in 1..N: dispatch to register-blocked templates.
template <int N, typename F>
XENC_INLINE void with_count(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) {
      with_count<N - 1>(n, std::forward<F>(f));
      return;
    }
  }
  f(std::integral_constant<int, N>{});
}

// x as it stands, rounded: the build contracts a * b + c into one FMA (-ffp-contract=fast), which skips the
// product's rounding; an empty asm that takes and gives x in its registers keeps a product a product.
XENC_INLINE vf materialized(vf x) {
#if XENC_AVX512
  asm("" : "+v"(x));
#elif defined(__x86_64__) || defined(__i386__)
  for (auto& part : x.part) asm("" : "+x"(part));
#elif defined(__aarch64__)
  for (auto& part : x.part) asm("" : "+w"(part));
#else
  volatile vf held = x;
  x = held;
#endif
  return x;
}

// x as the dtype T would hold it: a round trip through T, in registers where the CPU converts there; in fp32 x
// itself, rounded (``materialized``), so that a sum of rounded products rounds each product, as torch's ops do.
template <typename T>
XENC_INLINE vf rounded(vf x) {
  if constexpr (std::is_same_v<T, float>) {
    return materialized(x);
  } else {
#if XENC_AVX512
    if constexpr (std::is_same_v<T, BFloat16>) {
      return narrowed_bf16(x);
    } else {
      return narrowed_half(x);
    }
#else
    T tmp[16];
    store_first(tmp, x, 16);
    return load_first(tmp, 16);
#endif
  }
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A 64-byte aligned scratch buffer.
struct Scratch {
  struct Free {
    void operator()(void* p) const { c10::free_cpu(p); }
  };
  std::unique_ptr<void, Free> data;
  explicit Scratch(int64_t bytes) : data(c10::alloc_cpu(static_cast<size_t>(std::max<int64_t>(bytes, 64)))) {}
  template <typename U>
  U* as() const { return static_cast<U*>(data.get()); }
};

}  // namespace xenc_lab
