// Multi-head attention over a packed, padding-free token stream, for CPUs.
//
// The stream holds B sequences end to end: sequence b's keys and values are rows cu_k[b]:cu_k[b+1] of k and v,
// and its queries are rows cu_q[b]:cu_q[b+1] of q, which are the FIRST cu_q[b+1]-cu_q[b] tokens of the sequence
// (all of them for self-attention, one for "first token only"). Each row holds H heads of dh columns side by
// side; rows may be strided (column slices of a fused qkv tensor). Rows of the output outside every sequence are
// zero. Inputs and output are fp32, bf16 or fp16; scores, softmax and the weighted sum of values are fp32.
//
// Work is split into (sequence, head, block of queries) items, handed out dynamically to the intra-op threads;
// while a worker runs an item it prefetches the rows of the one it runs next. It handles an item in register
// blocks of kRows queries:
//   1. the keys of the (sequence, head) are packed once per thread into a transposed, 16-key-block layout (fp32,
//      or bf16 pairs for the AVX512_BF16 dot-product instruction where the build chooses it), so that 16 scores of
//      one query are dh FMAs of a broadcast query element with a row of that block; the values are copied to
//      contiguous fp32 rows (read in place, 4.6 KB apart, they fell into a few L1 sets and were evicted), or, in
//      the paired build, to rows of bf16 key pairs;
//   2. scores of the block's queries against every visible key go to a small buffer, with a running max;
//   3. one pass turns them into exp(s - max) (vectorized exp2) and sums them;
//   4. the probability-weighted sum of value rows accumulates in registers, is divided by the sum and stored.
//      In the paired build the numerators exp(s - max) are rounded to bf16 (their sum is the fp32 one) and the
//      sum runs on the bf16 dot product over pairs of keys, as torch's flash attention does on the CPU in bf16.
// This is an exact (non-online) softmax: no rescaling, the same arithmetic as softmax followed by a matmul. Each
// query's arithmetic is the same whichever block, item or thread computes it, so results are bitwise independent
// of the batch's other sequences and of the thread count.
//
// In bf16 and fp16 there is a second path, the tile path (TileWorker, below): the two products as oneDNN GEMMs
// (AMX tiles where the CPU has them), the same softmax between them. Which one runs is the caller's choice.
//
// The file also holds the row LayerNorm of 16-bit streams, an fp32 GEMM with its epilogue in cache (for fp32 layers
// with GELU, and for bf16 layers), and the GEMM of bf16 linear layers on fp16 FMAs (their sections, below).
//
// The kernel is written once over 16-lane fp32 vectors: AVX-512 intrinsics on x86 with AVX512F/BW/VL, GCC/Clang
// generic vectors elsewhere (which the compiler maps onto AVX2, SSE, NEON, ...).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/ParallelGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

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
// fp16 layers, below) run ATen's fp32 brgemm ukernel, on AVX2 or AVX-512.
#if (XENC_AVX512 || (defined(__AVX2__) && defined(__FMA__))) && defined(CPUBLAS_BRGEMM_F32F32F32)
#define XENC_GEMM_F32 1
#else
#define XENC_GEMM_F32 0
#endif

// The bf16 linear layers' fp16 GEMM (linear_half, below) needs AVX512-FP16 (fp16 FMAs on 32 lanes).
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
namespace {

using c10::BFloat16;
using c10::Half;

constexpr int64_t kMaxHeadDim = 256;

// ---------------------------------------------------------------------------------------------------------------
// 16-lane fp32 vectors. Masks select lanes by the low 16 bits of a uint32_t.

#if XENC_AVX512
// Register blocking: kRows queries x kKeyVecs 16-key vectors of scores, kRows x kColVecs 16-column vectors of
// outputs (24 of the 32 zmm registers).
constexpr int kRows = 6;
constexpr int kKeyVecs = 4;
constexpr int kColVecs = 4;

using vf = __m512;

XENC_INLINE vf zeros() { return _mm512_setzero_ps(); }
XENC_INLINE vf splat(float x) { return _mm512_set1_ps(x); }
XENC_INLINE vf load(const float* p) { return _mm512_load_ps(p); }  // p 64-byte aligned
XENC_INLINE vf loadu(const float* p) { return _mm512_loadu_ps(p); }
XENC_INLINE void store(float* p, vf x) { _mm512_store_ps(p, x); }  // p 64-byte aligned
XENC_INLINE vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
XENC_INLINE vf fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
XENC_INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
XENC_INLINE vf vand(vf a, vf b) { return _mm512_and_ps(a, b); }
XENC_INLINE vf vandnot(vf a, vf b) { return _mm512_andnot_ps(a, b); }  // ~a & b
XENC_INLINE vf vor(vf a, vf b) { return _mm512_or_ps(a, b); }
XENC_INLINE vf recip_estimate(vf d) { return _mm512_rcp14_ps(d); }  // 1 / d to 14 bits
XENC_INLINE float reduce_max(vf x) { return _mm512_reduce_max_ps(x); }
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
XENC_INLINE void store_first(BFloat16* p, vf x, int64_t n) {
#if XENC_BF16_DOT
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  const __m256i h = _mm512_cvtepi32_epi16(r);
#endif
  _mm256_mask_storeu_epi16(p, first_lanes(n), h);
}

// 2^x for x <= 0: x = n + f with |f| <= 1/2, 2^f by the Cephes exp2f polynomial (relative error ~2e-7), 2^n by
// vscalefps. Below -125 (-inf included) the result is 0: no lane computes a subnormal or underflowing value,
// each of which costs a microcode assist of ~100 cycles on Intel cores (the masked key lanes past a sequence's
// end, at -inf, did so once per row of scores). Such a term is < 2^-125 of the row's largest, which is 1.
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
// Blocking sized for 16 registers of 256 bits (AVX2) or 32 of 128 bits (NEON): 4 x 16 lanes of accumulators.
constexpr int kRows = 4;
constexpr int kKeyVecs = 1;
constexpr int kColVecs = 1;

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
// after the other filled the scheduler with waiting instructions. On Zen 1 (AVX2) these three changes made a
// pass of exps 1.3x as fast, and attention on 512-token pairs 1.05x, with the same bits out.
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

// ---------------------------------------------------------------------------------------------------------------
// Problem and work items.

// One call's inputs, as raw pointers and element strides.
template <typename T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  int64_t q_stride, k_stride, v_stride, out_stride;  // row strides, in elements
  std::vector<int64_t> cu_q, cu_k;
  int64_t num_heads, head_dim;
  float scale;
  int64_t half_window;  // key j is visible from query i iff |i - j| <= half_window; -1: every key is

  int64_t num_seqs() const { return static_cast<int64_t>(cu_q.size()) - 1; }
  int64_t num_queries(int64_t b) const { return cu_q[b + 1] - cu_q[b]; }
  int64_t num_keys(int64_t b) const { return cu_k[b + 1] - cu_k[b]; }
  // Visible keys of query position i in a sequence of nk keys: [key_begin, key_end).
  int64_t key_begin(int64_t i) const { return half_window < 0 ? 0 : std::max<int64_t>(0, i - half_window); }
  int64_t key_end(int64_t i, int64_t nk) const {
    return half_window < 0 ? nk : std::min<int64_t>(nk, i + half_window + 1);
  }
  // Head h of query position i of sequence b (likewise keys, values, output).
  const T* q_at(int64_t b, int64_t i, int64_t h) const { return q + (cu_q[b] + i) * q_stride + h * head_dim; }
  const T* k_at(int64_t b, int64_t j, int64_t h) const { return k + (cu_k[b] + j) * k_stride + h * head_dim; }
  const T* v_at(int64_t b, int64_t j, int64_t h) const { return v + (cu_k[b] + j) * v_stride + h * head_dim; }
  T* out_at(int64_t b, int64_t i, int64_t h) const { return out + (cu_q[b] + i) * out_stride + h * head_dim; }
};

// Queries [q_begin, q_end) of one head of one sequence.
struct Item {
  int64_t seq, head, q_begin, q_end;
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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

// ---------------------------------------------------------------------------------------------------------------
// The kernel.

// bf16 inputs use the bf16 pair dot product (vdpbf16ps) for scores and weighted sums where the CPU has it and the
// build asks for it (XENC_PAIRED_BF16, set where one does the work of two fp32 FMAs); fp32 FMAs on widened keys and
// values everywhere else.
#ifndef XENC_PAIRED_BF16
#define XENC_PAIRED_BF16 0
#endif
template <typename T>
constexpr bool kPairedKeys = std::is_same_v<T, BFloat16> && XENC_BF16_DOT && XENC_PAIRED_BF16;

// Transposes keys [0, nk) of one head into blocks of 16 keys: block k0/16 holds dh rows of 16 floats, element
// [d][j] being column d of key k0 + j. Keys past nk are zero.
template <typename T>
void pack_keys_f32(const T* k, int64_t stride, int64_t nk, int64_t dh, float* kt) {
  for (int64_t k0 = 0; k0 < nk; k0 += 16) {
    const int64_t rows = std::min<int64_t>(16, nk - k0);
    float* block = kt + k0 * dh;
    for (int64_t c0 = 0; c0 < dh; c0 += 16) {
      const int64_t cols = std::min<int64_t>(16, dh - c0);
      vf r[16];
      for (int64_t j = 0; j < 16; ++j) {
        r[j] = j < rows ? load_first(k + (k0 + j) * stride + c0, cols) : zeros();
      }
      transpose16(r);
      for (int64_t c = 0; c < cols; ++c) {
        store(block + (c0 + c) * 16, r[c]);
      }
    }
  }
}

template <int R, int N>
XENC_INLINE void set_zero(vf (&acc)[R][N]) {
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) {
      acc[r][n] = zeros();
    }
  }
}

// Row r of out = acc[r] * inv_sum[r], over NV * 16 columns of which the last vector has `tail` lanes.
template <int R, int NV, typename T>
XENC_INLINE void store_weighted_sums(vf (&acc)[R][NV], const float* inv_sum, T* out, int64_t out_stride,
                                     int64_t tail) {
  for (int r = 0; r < R; ++r) {
    const vf scale = splat(inv_sum[r]);
    for (int c = 0; c < NV; ++c) {
      store_first(out + r * out_stride + 16 * c, acc[r][c] * scale, c + 1 < NV ? 16 : tail);
    }
  }
}

// fp32 scores: R query rows (stride q_stride) against N consecutive 16-key blocks of the fp32 K^T layout.
template <int R, int N>
XENC_INLINE void score_tile(const float* q, int64_t q_stride, const float* kt, int64_t dh, vf (&acc)[R][N]) {
  set_zero(acc);
  for (int64_t d = 0; d < dh; ++d) {
    vf kv[N];
    for (int n = 0; n < N; ++n) {
      kv[n] = load(kt + n * dh * 16 + d * 16);
    }
    for (int r = 0; r < R; ++r) {
      const vf qb = splat(q[r * q_stride + d]);
      for (int n = 0; n < N; ++n) {
        acc[r][n] = fma(qb, kv[n], acc[r][n]);
      }
    }
  }
}

#if XENC_AVX512
// Keys [0, blocks_end) of one head (16-bit elements), 16 at a time, as dwords of column pairs transposed:
// store(k0, d2, row) receives the 16 dwords (d2, k0 .. k0 + 15), dword j holding columns 2 d2 and 2 d2 + 1 of key
// k0 + j (a zero pads odd dh; keys past nk are zero).
template <typename T, typename Store>
XENC_INLINE void transpose_key_pairs(const T* k, int64_t stride, int64_t nk, int64_t blocks_end, int64_t dh,
                                     Store&& store) {
  for (int64_t k0 = 0; k0 < blocks_end; k0 += 16) {
    for (int64_t c0 = 0; c0 < dh; c0 += 32) {
      const int64_t cols = std::min<int64_t>(32, dh - c0);
      const __mmask32 mask = static_cast<__mmask32>(cols == 32 ? ~0ull : (1ull << cols) - 1);
      vf r[16];
      for (int64_t j = 0; j < 16; ++j) {
        r[j] = k0 + j < nk ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, k + (k0 + j) * stride + c0)) : zeros();
      }
      transpose16(r);
      for (int64_t c = 0; c < (cols + 1) / 2; ++c) {
        store(k0, c0 / 2 + c, r[c]);
      }
    }
  }
}

// Values [0, keys_end) of one head (16-bit elements) as key pairs for the 16-bit dot products: row j / 2, of
// row_stride dwords, holds in dword c columns c of keys j and j + 1 (zero past nk and past dh).
template <typename T>
void pack_value_pairs(const T* v, int64_t stride, int64_t nk, int64_t keys_end, int64_t dh, int64_t row_stride,
                      uint32_t* dst) {
  for (int64_t j = 0; j < keys_end; j += 2) {
    for (int64_t c0 = 0; c0 < row_stride; c0 += 16) {
      const __mmask16 load = first_lanes(std::clamp<int64_t>(dh - c0, 0, 16));
      const __m256i a = j < nk ? _mm256_maskz_loadu_epi16(load, v + j * stride + c0) : _mm256_setzero_si256();
      const __m256i b = j + 1 < nk ? _mm256_maskz_loadu_epi16(load, v + (j + 1) * stride + c0) : _mm256_setzero_si256();
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      const __mmask16 store = first_lanes(std::min<int64_t>(16, row_stride - c0));
      _mm512_mask_storeu_epi32(dst + (j / 2) * row_stride + c0, store, pair);
    }
  }
}
#endif  // XENC_AVX512

#if XENC_BF16_DOT
// The paired layout for the bf16 dot product: block k0/16 holds ceil(dh/2) rows of 16 dwords, element [d2][j]
// being columns 2 d2 and 2 d2 + 1 of key k0 + j (a zero pads odd dh). Keys past nk are zero.
void pack_keys_bf16_pairs(const BFloat16* k, int64_t stride, int64_t nk, int64_t dh, uint32_t* kt) {
  const int64_t pairs = (dh + 1) / 2;
  transpose_key_pairs(k, stride, nk, nk, dh, [&](int64_t k0, int64_t d2, vf row) {
    store(reinterpret_cast<float*>(kt + k0 * pairs + d2 * 16), row);
  });
}

// bf16 scores: R rows of query pairs (stride q_stride dwords) against N blocks of the paired K^T layout.
template <int R, int N>
XENC_INLINE void score_tile(const uint32_t* q, int64_t q_stride, const uint32_t* kt, int64_t pairs,
                            vf (&acc)[R][N]) {
  set_zero(acc);
  for (int64_t d = 0; d < pairs; ++d) {
    __m512i kv[N];
    for (int n = 0; n < N; ++n) {
      kv[n] = _mm512_load_si512(kt + n * pairs * 16 + d * 16);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(q[r * q_stride + d]));
      for (int n = 0; n < N; ++n) {
        acc[r][n] =
            _mm512_dpbf16_ps(acc[r][n], reinterpret_cast<__m512bh>(qb), reinterpret_cast<__m512bh>(kv[n]));
      }
    }
  }
}

// out[r] = (sum_j p[r][j] v[j]) * inv_sum[r] over NV * 16 columns (the last vector `tail` lanes wide), with the
// numerators p rounded to bf16 (rows of p_stride bf16) and the bf16 dot product over key pairs of the paired values.
template <int R, int NV, typename T>
XENC_INLINE void weighted_sum_tile(const BFloat16* p, int64_t p_stride, const uint32_t* v, int64_t v_stride,
                                   int64_t num_pairs, int64_t tail, const float* inv_sum, T* out,
                                   int64_t out_stride) {
  vf acc[R][NV];
  set_zero(acc);
  for (int64_t j2 = 0; j2 < num_pairs; ++j2) {
    __m512i vv[NV];
    for (int c = 0; c < NV; ++c) {
      vv[c] = _mm512_load_si512(v + j2 * v_stride + 16 * c);
    }
    for (int r = 0; r < R; ++r) {
      int32_t w2;
      std::memcpy(&w2, p + r * p_stride + 2 * j2, sizeof(w2));
      const __m512i w = _mm512_set1_epi32(w2);
      for (int c = 0; c < NV; ++c) {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], reinterpret_cast<__m512bh>(w), reinterpret_cast<__m512bh>(vv[c]));
      }
    }
  }
  store_weighted_sums(acc, inv_sum, out, out_stride, tail);
}
#endif  // XENC_BF16_DOT

// Scores of R queries against N * 16 keys: accumulators -> scaled by c, keys outside each query's [lo, hi)
// set to -inf when `masked`, stored to rows of s and folded into the running maxima.
template <int R, int N>
XENC_INLINE void store_scores(vf (&acc)[R][N], float c, const int64_t* lo, const int64_t* hi, int64_t k0,
                              bool masked, float* s, int64_t s_stride, vf* row_max) {
  const vf cv = splat(c);
  for (int r = 0; r < R; ++r) {
    vf m = row_max[r];
    for (int n = 0; n < N; ++n) {
      vf x = acc[r][n] * cv;
      if (masked) {
        const int64_t base = k0 + 16 * n;
        x = keep_lanes(x, lane_range(lo[r] - base, hi[r] - base), -std::numeric_limits<float>::infinity());
      }
      store(s + r * s_stride + 16 * n, x);
      m = vmax(m, x);
    }
    row_max[r] = m;
  }
}

// out[r] = (sum_j p[r][j] v[j]) * inv_sum[r] over NV * 16 columns, of which the last vector has `tail` lanes
// (stored; the value rows are read whole: they are zero-padded to whole vectors).
template <int R, int NV, typename T>
XENC_INLINE void weighted_sum_tile(const float* p, int64_t p_stride, const float* v, int64_t v_stride,
                                   int64_t num_keys, int64_t tail, const float* inv_sum, T* out,
                                   int64_t out_stride) {
  vf acc[R][NV];
  set_zero(acc);
  for (int64_t j = 0; j < num_keys; ++j) {
    const float* row = v + j * v_stride;
    vf vv[NV];
    for (int c = 0; c < NV; ++c) {
      vv[c] = load(row + 16 * c);
    }
    for (int r = 0; r < R; ++r) {
      const vf w = splat(p[r * p_stride + j]);
      for (int c = 0; c < NV; ++c) {
        acc[r][c] = fma(w, vv[c], acc[r][c]);
      }
    }
  }
  store_weighted_sums(acc, inv_sum, out, out_stride, tail);
}

template <typename T>
class Worker {
  using KeyT = std::conditional_t<kPairedKeys<T>, uint32_t, float>;  // element of the packed K^T and queries

 public:
  static constexpr int64_t kBlock = kRows;  // items split their queries at multiples of this

  Worker(const Problem<T>& p, int64_t max_keys)
      : p_(p),
        dh_(p.head_dim),
        dh16_(round_up(p.head_dim, 16)),
        key_width_(kPairedKeys<T> ? (p.head_dim + 1) / 2 : p.head_dim),
        s_stride_(round_up(std::max<int64_t>(max_keys, 1), 16)),
        keys_(s_stride_ * key_width_ * static_cast<int64_t>(sizeof(KeyT))),
        values_(max_keys * dh16_ * static_cast<int64_t>(sizeof(float))),
        scores_(kRows * s_stride_ * static_cast<int64_t>(sizeof(float))),
        queries_(kRows * round_up(key_width_, 16) * static_cast<int64_t>(sizeof(KeyT))),
        probs_(kPairedKeys<T> ? kRows * s_stride_ * static_cast<int64_t>(sizeof(BFloat16)) : 0),
        scale_log2e_(static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634)) {}

  // Runs `it`; `next` (if any) is the item this thread runs after it, whose rows are prefetched meanwhile.
  void run(const Item& it, const Item* next) {
    if (it.seq != packed_seq_ || it.head != packed_head_) {
      pack(it.seq, it.head);
    }
    // The item's queries in blocks of kRows or kRows - 1 (91 queries: 11 x 6 + 5 x 5, not 15 x 6 + 1): a block
    // of one or two rows runs at the latency of its few accumulator chains, not at the throughput of the FMAs.
    const int64_t n = it.q_end - it.q_begin, blocks = (n + kRows - 1) / kRows;
    const int64_t small = blocks * kRows - n < blocks ? blocks * kRows - n : 0;  // blocks of kRows - 1 rows
    Lookahead ahead(*this, it, next, blocks);
    for (int64_t b = 0, i = it.q_begin; i < it.q_end; ++b) {
      const int64_t rows =
          small > 0 ? (b < blocks - small ? kRows : kRows - 1) : std::min<int64_t>(kRows, it.q_end - i);
      for (int64_t r = i + rows; r < std::min<int64_t>(i + rows + kRows, it.q_end); ++r) {
        prefetch_slice<Into::L1>(p_.q_at(it.seq, r, it.head));  // the next block's queries
      }
      ahead.step();
      with_count<kRows>(rows, [&](auto count) { block<count()>(it, i); });
      i += rows;
    }
  }

 private:
  enum class Into { L1, L2, L1ForWriting };

  // Prefetches the head's slice of one row.
  template <Into Where>
  XENC_INLINE void prefetch_slice(const T* row) const {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t b = 0; b < dh_ * static_cast<int64_t>(sizeof(T)); b += 64) {
      if constexpr (Where == Into::L1) {
        __builtin_prefetch(bytes + b, 0, 3);
      } else if constexpr (Where == Into::L2) {
        __builtin_prefetch(bytes + b, 0, 2);
      } else {
        __builtin_prefetch(bytes + b, 1, 3);
      }
    }
  }

  // The rows the next item touches first (keys and values unless it shares this item's, queries, then output rows
  // for writing), prefetched a few at a time over the query blocks of the current item so that their cache misses
  // overlap with compute.
  class Lookahead {
   public:
    Lookahead(const Worker& w, const Item& current, const Item* next, int64_t blocks)
        : w_(w),
          next_(next),
          num_keys_(next && (next->seq != current.seq || next->head != current.head) ? w.p_.num_keys(next->seq) : 0),
          num_queries_(next ? next->q_end - next->q_begin : 0),
          total_(2 * num_keys_ + 2 * num_queries_),
          per_block_((total_ + blocks - 1) / blocks) {}

    void step() {
      const Problem<T>& p = w_.p_;
      for (const int64_t end = std::min(total_, done_ + per_block_); done_ < end; ++done_) {
        const int64_t i = done_, seq = next_->seq, head = next_->head;
        if (i < num_keys_) {
          w_.template prefetch_slice<Into::L2>(p.k_at(seq, i, head));
        } else if (i < 2 * num_keys_) {
          w_.template prefetch_slice<Into::L2>(p.v_at(seq, i - num_keys_, head));
        } else if (i < 2 * num_keys_ + num_queries_) {
          w_.template prefetch_slice<Into::L2>(p.q_at(seq, next_->q_begin + i - 2 * num_keys_, head));
        } else {
          w_.template prefetch_slice<Into::L1ForWriting>(
              p.out_at(seq, next_->q_begin + i - 2 * num_keys_ - num_queries_, head));
        }
      }
    }

   private:
    const Worker& w_;
    const Item* next_;
    const int64_t num_keys_, num_queries_, total_, per_block_;
    int64_t done_ = 0;
  };

  // K^T of (seq, head) into keys_; for 16-bit types, values widened to fp32 rows of dh16_ into values_ (the
  // paired build: bf16 key pairs, rows of dh16_ dwords).
  void pack(int64_t seq, int64_t head) {
    const int64_t nk = p_.num_keys(seq);
    if constexpr (kPairedKeys<T>) {
#if XENC_BF16_DOT
      pack_keys_bf16_pairs(p_.k_at(seq, 0, head), p_.k_stride, nk, dh_, keys_.as<uint32_t>());
      pack_value_pairs(p_.v_at(seq, 0, head), p_.v_stride, nk, nk, dh_, dh16_, values_.as<uint32_t>());
#endif
    } else {
      pack_keys_f32(p_.k_at(seq, 0, head), p_.k_stride, nk, dh_, keys_.as<float>());
      float* dst = values_.as<float>();
      for (int64_t j = 0; j < nk; ++j) {
        const T* src = p_.v_at(seq, j, head);
        for (int64_t c = 0; c < dh16_; c += 16) {
          store(dst + j * dh16_ + c, load_first(src + c, std::min<int64_t>(16, dh_ - c)));
        }
      }
    }
    packed_seq_ = seq;
    packed_head_ = head;
  }

  // Query rows of the block in the layout score_tile takes: the input itself for fp32, else a copy in queries_.
  const KeyT* query_rows(const Item& it, int64_t i0, int64_t rows, int64_t* stride) {
    if constexpr (std::is_same_v<T, float>) {
      *stride = p_.q_stride;
      return p_.q_at(it.seq, i0, it.head);
    } else {
      const int64_t width = round_up(key_width_, 16);
      KeyT* dst = queries_.as<KeyT>();
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = p_.q_at(it.seq, i0 + r, it.head);
        if constexpr (kPairedKeys<T>) {  // bf16 pairs: the raw row, zero-padded to whole dwords
#if XENC_BF16_DOT
          for (int64_t c = 0; c < dh_; c += 32) {
            const int64_t cols = std::min<int64_t>(32, dh_ - c);
            const __mmask32 mask = static_cast<__mmask32>(cols == 32 ? ~0ull : (1ull << cols) - 1);
            _mm512_storeu_si512(dst + r * width + c / 2, _mm512_maskz_loadu_epi16(mask, src + c));
          }
#endif
        } else {
          for (int64_t c = 0; c < dh_; c += 16) {
            store(dst + r * width + c, load_first(src + c, std::min<int64_t>(16, dh_ - c)));
          }
        }
      }
      *stride = width;
      return dst;
    }
  }

  // Queries i0 .. i0 + R - 1 of the item.
  template <int R>
  void block(const Item& it, int64_t i0) {
    const int64_t nk = p_.num_keys(it.seq);
    int64_t lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = p_.key_begin(i0 + r);
      hi[r] = p_.key_end(i0 + r, nk);
    }
    // Keys [k_begin, k_end) cover every row's visible keys; scores start at the 16-key block of k_begin.
    const int64_t k_begin = lo[0], k_end = hi[R - 1], k_base = k_begin / 16 * 16;
    float* s = scores_.as<float>();

    int64_t q_stride;
    const KeyT* q = query_rows(it, i0, R, &q_stride);
    vf row_max[R];
    for (int r = 0; r < R; ++r) {
      row_max[r] = splat(-std::numeric_limits<float>::infinity());
    }
    for (int64_t k0 = k_base; k0 < k_end; k0 += 16 * kKeyVecs) {
      const int64_t vecs = std::min<int64_t>(kKeyVecs, (k_end - k0 + 15) / 16);
      const bool masked = lo[R - 1] > k0 || hi[0] < k0 + 16 * vecs;
      const KeyT* kt = keys_.as<KeyT>() + k0 * key_width_;
      with_count<kKeyVecs>(vecs, [&](auto n) {
        vf acc[R][n()];
        score_tile<R, n()>(q, q_stride, kt, key_width_, acc);
        store_scores<R, n()>(acc, scale_log2e_, lo, hi, k0, masked, s + (k0 - k_base), s_stride_, row_max);
      });
    }

    // Softmax numerators exp(s - max) in place (scores carry log2(e), so exp2), and 1 / their sums.
    const int64_t length = round_up(k_end - k_base, 16);
    float inv_sum[R];
    for (int r = 0; r < R; ++r) {
      const vf top = splat(reduce_max(row_max[r]));
      float* row = s + r * s_stride_;
      vf sum = zeros();
      for (int64_t j = 0; j < length; j += 16) {
        const vf e = exp2_nonpositive(load(row + j) - top);
        if constexpr (kPairedKeys<T>) {  // rounded to bf16 for the dot product; the sum is of the fp32 ones
#if XENC_BF16_DOT
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs_.as<BFloat16>() + r * s_stride_ + j),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
#endif
        } else {
          store(row + j, e);
        }
        sum = sum + e;
      }
      inv_sum[r] = 1.f / reduce_add(sum);
    }

    // Weighted sums of the value rows, kColVecs * 16 columns at a time. The paired build runs over key pairs, from
    // the even key at or below k_begin to the odd one at or past k_end - 1 (a key outside [k_begin, k_end) has
    // p = 0 there, as any key outside a row's own visible keys has).
    const auto [p, v, count] = [&] {
      if constexpr (kPairedKeys<T>) {
        const int64_t j2_begin = k_begin / 2, j2_end = (k_end + 1) / 2;
        return std::tuple(probs_.as<BFloat16>() + (2 * j2_begin - k_base), values_.as<uint32_t>() + j2_begin * dh16_,
                          j2_end - j2_begin);
      } else {
        return std::tuple(s + (k_begin - k_base), values_.as<float>() + k_begin * dh16_, k_end - k_begin);
      }
    }();
    T* out = p_.out_at(it.seq, i0, it.head);
    for (int64_t c0 = 0; c0 < dh_; c0 += 16 * kColVecs) {
      const int64_t cols = std::min<int64_t>(16 * kColVecs, dh_ - c0);
      const int64_t tail = cols - 16 * ((cols - 1) / 16);
      with_count<kColVecs>((cols + 15) / 16, [&](auto nv) {
        weighted_sum_tile<R, nv()>(p, s_stride_, v + c0, dh16_, count, tail, inv_sum, out + c0, p_.out_stride);
      });
    }
  }

  const Problem<T>& p_;
  const int64_t dh_, dh16_;
  const int64_t key_width_;  // elements per key in the packed K^T: dh floats or ceil(dh / 2) bf16 pairs
  const int64_t s_stride_;   // floats per row of scores_, >= every sequence's key count rounded up to 16
  Scratch keys_, values_, scores_, queries_, probs_;
  const float scale_log2e_;
  int64_t packed_seq_ = -1, packed_head_ = -1;
};

// ---------------------------------------------------------------------------------------------------------------
// The tile path (bf16, fp16): per block of kTileQueries queries, S = Q K^T and O = P V are batch-reduce GEMMs of
// ATen's cpublas (oneDNN's brgemm ukernel: AMX tiles where the CPU has them, AVX-512 dot products elsewhere), and
// the softmax between them runs as in the kernel, in fp32. P is rounded to the input type before P V (as torch's
// flash attention does on the CPU); the sums that divide O are those of the unrounded fp32 numerators.
// Every GEMM shape depends only on the sequence's own length and the head shape, so a pair's result is bitwise
// independent of its batchmates and of the thread count, as in the kernel.

#if XENC_TILES
constexpr int64_t kTileQueries = 32;  // queries per block: two 16-row AMX tiles
constexpr int64_t kTileKeys = 32;     // keys are padded to a multiple: whole tiles of keys, whole VNNI pairs

template <typename T>
class TileWorker {
  static_assert(sizeof(T) == 2, "the tile path takes 16-bit inputs");

 public:
  static constexpr int64_t kBlock = kTileQueries;

  TileWorker(const Problem<T>& p, int64_t max_keys)
      : p_(p),
        dh_(p.head_dim),
        dh2_(round_up(p.head_dim, 2)),
        max_keys_(round_up(std::max<int64_t>(max_keys, 1), kTileKeys)),
        keys_(dh2_ * max_keys_ * 2),
        values_(max_keys_ * dh_ * 2),
        queries_(kTileQueries * dh2_ * 2),
        scores_(kTileQueries * max_keys_ * 4),
        probs_(kTileQueries * max_keys_ * 2),
        outs_(kTileQueries * dh_ * 4),
        scale_log2e_(static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634)) {}

  ~TileWorker() { at::native::cpublas::brgemm_release(true); }  // AMX: hand the tile state back

  void run(const Item& it, const Item*) {
    if (it.seq != packed_seq_ || it.head != packed_head_) {
      pack(it.seq, it.head);
    }
    for (int64_t i = it.q_begin; i < it.q_end; i += kTileQueries) {
      block(it, i, std::min<int64_t>(kTileQueries, it.q_end - i));
    }
  }

 private:
  // Keys and values of (seq, head), padded with zero rows to padded_keys_, in the VNNI layout the brgemm takes
  // for 16-bit B: element (r, c) of a K x N matrix at [r / 2][c][r % 2]. For S = Q K^T, B = K^T (dh2_ x keys):
  // dword [d / 2][j] holds columns d, d + 1 of key j, a transpose of the keys' dwords. For O = P V, B = V
  // (keys x dh): dword [j / 2][c] holds column c of keys j and j + 1.
  void pack(int64_t seq, int64_t head) {
    const int64_t nk = p_.num_keys(seq);
    padded_keys_ = round_up(nk, kTileKeys);
    uint32_t* kt = keys_.as<uint32_t>();
    transpose_key_pairs(p_.k_at(seq, 0, head), p_.k_stride, nk, padded_keys_, dh_, [&](int64_t k0, int64_t d2, vf row) {
      _mm512_storeu_ps(reinterpret_cast<float*>(kt + d2 * padded_keys_ + k0), row);
    });
    pack_value_pairs(p_.v_at(seq, 0, head), p_.v_stride, nk, padded_keys_, dh_, dh_, values_.as<uint32_t>());
    packed_seq_ = seq;
    packed_head_ = head;
  }

  // Queries i0 .. i0 + rows - 1 of the item (rows <= kTileQueries; the GEMMs always run kTileQueries rows, the
  // rows past `rows` being zero queries whose outputs are not stored).
  void block(const Item& it, int64_t i0, int64_t rows) {
    const int64_t nk = p_.num_keys(it.seq);
    // The block's visible keys, widened to whole tiles: [k_base, k_base + width).
    const int64_t k_base = p_.key_begin(i0) / kTileKeys * kTileKeys;
    const int64_t width = std::min(padded_keys_, round_up(p_.key_end(i0 + rows - 1, nk), kTileKeys)) - k_base;

    T* q = queries_.as<T>();
    for (int64_t r = 0; r < kTileQueries; ++r) {  // a zero column pads an odd head_dim, zero rows the block
      for (int64_t c0 = 0; c0 < dh2_; c0 += 32) {
        const int64_t cols = std::min<int64_t>(32, dh2_ - c0), real = r < rows ? std::min<int64_t>(32, dh_ - c0) : 0;
        const __mmask32 load = static_cast<__mmask32>(real == 32 ? ~0ull : (1ull << real) - 1);
        const __mmask32 store = static_cast<__mmask32>(cols == 32 ? ~0ull : (1ull << cols) - 1);
        const T* src = p_.q_at(it.seq, i0 + std::min(r, rows - 1), it.head) + c0;
        _mm512_mask_storeu_epi16(q + r * dh2_ + c0, store, _mm512_maskz_loadu_epi16(load, src));
      }
    }
    float* s = scores_.as<float>();
    at::native::cpublas::brgemm(kTileQueries, width, dh2_, dh2_, padded_keys_, width, false, q,
                                keys_.as<T>() + 2 * k_base, s, true);

    // Softmax numerators exp(s - max) over each query's visible keys, rounded into P; zero elsewhere. The max
    // is taken of the raw scores and scaled once (for a negative scale, the min), and exp2(c s - c max) is one FMA
    // and the exponential per element: masking touches only the 16-key blocks that straddle [lo, hi).
    T* probs = probs_.as<T>();
    float inv_sum[kTileQueries];
    const bool negative = scale_log2e_ < 0.f;
    const float inf = std::numeric_limits<float>::infinity();
    const vf c = splat(scale_log2e_), sign = splat(negative ? -1.f : 1.f);
    for (int64_t r = 0; r < kTileQueries; ++r) {
      T* prow = probs + r * width;
      if (r >= rows) {
        std::memset(prow, 0, width * sizeof(T));
        continue;
      }
      const int64_t lo = p_.key_begin(i0 + r) - k_base, hi = p_.key_end(i0 + r, nk) - k_base;
      const int64_t j_lo = lo / 16 * 16, j_hi = round_up(hi, 16);  // the blocks holding visible keys
      const float* row = s + r * width;
      // The extreme raw score: the max, or for a negative scale the min (max of the negated scores).
      vf m = splat(-inf);
      for (int64_t j = j_lo; j < j_hi; j += 16) {
        vf x = load(row + j) * sign;
        if (j < lo || j + 16 > hi) {
          x = keep_lanes(x, lane_range(lo - j, hi - j), -inf);
        }
        m = vmax(m, x);
      }
      const vf minus_top = splat(-reduce_max(m) * (negative ? -scale_log2e_ : scale_log2e_));
      vf sum = zeros();
      std::memset(prow, 0, j_lo * sizeof(T));
      for (int64_t j = j_lo; j < j_hi; j += 16) {
        vf e = exp2_nonpositive(fma(load(row + j), c, minus_top));
        if (j < lo || j + 16 > hi) {
          e = keep_lanes(e, lane_range(lo - j, hi - j), 0.f);
        }
        store_first(prow + j, e, 16);
        sum = sum + e;
      }
      std::memset(prow + j_hi, 0, (width - j_hi) * sizeof(T));
      inv_sum[r] = 1.f / reduce_add(sum);
    }

    float* o = outs_.as<float>();
    at::native::cpublas::brgemm(kTileQueries, dh_, width, width, dh_, dh_, false, probs,
                                values_.as<T>() + k_base * dh_, o, true);
    for (int64_t r = 0; r < rows; ++r) {
      T* out = p_.out_at(it.seq, i0 + r, it.head);
      const vf scale = splat(inv_sum[r]);
      for (int64_t c0 = 0; c0 < dh_; c0 += 16) {
        const int64_t cols = std::min<int64_t>(16, dh_ - c0);
        store_first(out + c0, load_first(o + r * dh_ + c0, cols) * scale, cols);
      }
    }
  }

  const Problem<T>& p_;
  const int64_t dh_, dh2_;   // head_dim, and it rounded up to whole pairs (the K of S = Q K^T)
  const int64_t max_keys_;   // the longest sequence's keys, padded to kTileKeys
  Scratch keys_, values_, queries_, scores_, probs_, outs_;
  const float scale_log2e_;
  int64_t padded_keys_ = 0;  // the packed sequence's keys, padded to kTileKeys
  int64_t packed_seq_ = -1, packed_head_ = -1;
};
#endif  // XENC_TILES

// ---------------------------------------------------------------------------------------------------------------
// Scheduling.

// Splits the problem into items and runs them on the intra-op threads, each with a Worker of its own.
// Sequences go longest first and items are taken from a shared counter, so threads finish together even when
// lengths vary or another process takes a core. A (sequence, head) is split into query blocks only when there
// are too few of them to keep every thread busy; a worker reuses its packed keys across consecutive items.
template <typename W, typename T>
void run_items(const Problem<T>& p) {
  const int64_t num_threads = at::get_num_threads();
  std::vector<int64_t> seqs;
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.num_seqs(); ++b) {
    if (p.num_queries(b) > 0) {
      seqs.push_back(b);
      max_keys = std::max(max_keys, p.num_keys(b));
    }
  }
  if (seqs.empty()) {
    return;
  }
  auto cost = [&](int64_t b) {
    const int64_t nk = p.num_keys(b);
    const int64_t visible = p.half_window < 0 ? nk : std::min(nk, 2 * p.half_window + 1);
    return p.num_queries(b) * visible + nk;
  };
  std::stable_sort(seqs.begin(), seqs.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });

  const int64_t pairs = static_cast<int64_t>(seqs.size()) * p.num_heads;
  const int64_t wanted = 8 * num_threads;
  const int64_t splits = pairs >= wanted ? 1 : (wanted + pairs - 1) / pairs;
  std::vector<Item> items;
  for (int64_t b : seqs) {
    const int64_t nq = p.num_queries(b);
    const int64_t block = round_up((nq + splits - 1) / splits, W::kBlock);
    for (int64_t h = 0; h < p.num_heads; ++h) {
      for (int64_t i = 0; i < nq; i += block) {
        items.push_back({b, h, i, std::min(nq, i + block)});
      }
    }
  }

  // Each thread claims its next item before running the current one, so the worker can prefetch its rows.
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> counter{0};
  at::parallel_for(0, std::min(num_threads, num_items), 1, [&](int64_t, int64_t) {
    W worker(p, max_keys);
    for (int64_t i = counter.fetch_add(1, std::memory_order_relaxed); i < num_items;) {
      const int64_t next = counter.fetch_add(1, std::memory_order_relaxed);
      worker.run(items[i], next < num_items ? &items[next] : nullptr);
      i = next;
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// LayerNorm over the rows of a (T, d) stream: two passes in fp32 over the row widened once into a buffer (mean,
// then the mean of squared deviations), y = (x - mean) * rstd * weight + bias rounded once to the row's type.
// torch's CPU LayerNorm computes the same in fp32 with another summation order: outputs differ by fp32 rounding
// (bf16 and fp16 outputs are equal but where that rounding crosses a rounding boundary of the dtype).

template <typename T>
void layer_norm_rows(const T* x, int64_t x_stride, const T* weight, const T* bias, T* y, int64_t rows, int64_t d,
                     float eps) {
  const int64_t width = round_up(d, 16);
  Scratch affine(2 * width * static_cast<int64_t>(sizeof(float)));  // weight and bias widened once, zero-padded
  float* w = affine.as<float>();
  float* b = w + width;
  for (int64_t c = 0; c < width; c += 16) {
    const int64_t n = std::clamp<int64_t>(d - c, 0, 16);
    store(w + c, weight ? load_first(weight + c, n) : keep_lanes(splat(1.f), lane_range(0, n), 0.f));
    store(b + c, bias ? load_first(bias + c, n) : zeros());
  }
  // Rows in groups of kNormRows, each pass over all of the group's rows before the next pass: a row's passes
  // depend on each other through its sums (two horizontal reductions and a square root), the rows do not, so
  // the core overlaps one row's reductions with the next row's pass instead of waiting on them. The next group's
  // rows are prefetched meanwhile: the loads of a row just written by a GEMM, from L2 or L3, were most of the time.
  // (On 4096 x 384 bf16 rows from L3: 180-195 us against 360-410 one row at a time, and 300-320 for torch's.)
  constexpr int64_t kNormRows = 4;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    Scratch row_buffer(kNormRows * width * static_cast<int64_t>(sizeof(float)));
    const float inv_d = 1.f / static_cast<float>(d);
    for (int64_t r0 = begin; r0 < end; r0 += kNormRows) {
      const int64_t n = std::min(kNormRows, end - r0);
      float mean[kNormRows], rstd[kNormRows];
      for (int64_t r = r0 + kNormRows; r < std::min(r0 + 2 * kNormRows, end); ++r) {  // the next group's rows
        for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(T)); byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(x + r * x_stride) + byte, 0, 3);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const T* xr = x + (r0 + i) * x_stride;
        float* buf = row_buffer.as<float>() + i * width;
        vf sum = zeros();
        for (int64_t c = 0; c < width; c += 16) {
          const vf v = load_first(xr + c, std::min<int64_t>(16, d - c));  // zero past d
          store(buf + c, v);
          sum = sum + v;
        }
        mean[i] = reduce_add(sum) * inv_d;
      }
      for (int64_t i = 0; i < n; ++i) {
        const float* buf = row_buffer.as<float>() + i * width;
        const vf m = splat(mean[i]);
        vf squares = zeros();
        for (int64_t c = 0; c < width; c += 16) {
          vf dev = load(buf + c) - m;
          if (c + 16 > d) {
            dev = keep_lanes(dev, lane_range(0, d - c), 0.f);
          }
          squares = fma(dev, dev, squares);
        }
        rstd[i] = 1.f / std::sqrt(reduce_add(squares) * inv_d + eps);
      }
      for (int64_t i = 0; i < n; ++i) {
        const float* buf = row_buffer.as<float>() + i * width;
        const vf m = splat(mean[i]), s = splat(rstd[i]);
        T* yr = y + (r0 + i) * d;
        for (int64_t c = 0; c < width; c += 16) {
          const vf v = fma((load(buf + c) - m) * s, load(w + c), load(b + c));
          store_first(yr + c, v, std::min<int64_t>(16, d - c));
        }
      }
    }
  });
}

at::Tensor layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                      double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "layer_norm takes a 2-D CPU tensor, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "layer_norm supports float32, bfloat16 and float16, got ", x.scalar_type());
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
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* w = weight.has_value() ? weight->const_data_ptr<T>() : nullptr;
    const T* b = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
    layer_norm_rows<T>(x.const_data_ptr<T>(), x.stride(0), w, b, y.mutable_data_ptr<T>(), x.size(0), x.size(1),
                       static_cast<float>(eps));
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else if (x.scalar_type() == at::kBFloat16) {
    run(BFloat16{});
  } else {
    run(Half{});
  }
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// The operator.

std::vector<int64_t> read_offsets(const at::Tensor& cu, const char* name) {
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1, name, " must be 1-D with at least one element, got shape ",
              cu.sizes());
  TORCH_CHECK(cu.device().is_cpu(), name, " must be on the CPU");
  std::vector<int64_t> out(cu.numel());
  if (cu.scalar_type() == at::kInt) {
    const auto a = cu.accessor<int32_t, 1>();
    for (int64_t i = 0; i < cu.numel(); ++i) out[i] = a[i];
  } else {
    TORCH_CHECK(cu.scalar_type() == at::kLong, name, " must be int32 or int64, got ", cu.scalar_type());
    const auto a = cu.accessor<int64_t, 1>();
    for (int64_t i = 0; i < cu.numel(); ++i) out[i] = a[i];
  }
  return out;
}

void check_operand(const at::Tensor& x, const char* name, const at::Tensor& q) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 2, name, " must be 2-D (tokens, heads * head_dim), got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == q.scalar_type(), name, " has dtype ", x.scalar_type(), " but q has ",
              q.scalar_type());
  TORCH_CHECK(x.size(1) == q.size(1), name, " has ", x.size(1), " columns but q has ", q.size(1));
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, name, " must have contiguous columns (stride 1), got strides ",
              x.strides());
  TORCH_CHECK(x.size(0) <= 1 || x.stride(0) >= 0, name, " must have non-negative row stride");
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, std::vector<int64_t> cu_q,
         std::vector<int64_t> cu_k, int64_t num_heads, double scale, int64_t window, bool tiles) {
  Problem<T> p{q.const_data_ptr<T>(), k.const_data_ptr<T>(), v.const_data_ptr<T>(), out.mutable_data_ptr<T>(),
               q.stride(0), k.stride(0), v.stride(0), out.stride(0), std::move(cu_q), std::move(cu_k),
               num_heads, q.size(1) / num_heads, static_cast<float>(scale), window < 0 ? -1 : window / 2};
  // Rows outside every sequence (a filler tail) are zero.
  const int64_t row_bytes = out.size(1) * static_cast<int64_t>(sizeof(T));
  if (out.numel() > 0) {
    std::memset(p.out, 0, p.cu_q.front() * row_bytes);
    std::memset(p.out + p.cu_q.back() * p.out_stride, 0, (out.size(0) - p.cu_q.back()) * row_bytes);
  }
  if constexpr (std::is_same_v<T, float>) {
    run_items<Worker<T>>(p);
  } else {
#if XENC_TILES
    if (tiles) {
      run_items<TileWorker<T>>(p);
      return;
    }
#endif
    run_items<Worker<T>>(p);
  }
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& cu_seqlens_k, int64_t num_heads, double scale, int64_t window, bool tiles) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "packed_attention supports float32, bfloat16 and float16, got ", q.scalar_type());
  check_operand(q, "q", q);
  check_operand(k, "k", q);
  check_operand(v, "v", q);
  TORCH_CHECK(num_heads > 0 && q.size(1) % num_heads == 0, "num_heads (", num_heads, ") must divide the ",
              q.size(1), " columns of q");
  const int64_t head_dim = q.size(1) / num_heads;
  TORCH_CHECK(head_dim >= 1 && head_dim <= kMaxHeadDim, "head_dim must be in [1, ", kMaxHeadDim, "], got ",
              head_dim);
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(window >= -1, "window must be >= 0 (or -1 for full attention), got ", window);

  TORCH_CHECK(!tiles || XENC_TILES, "the tile path was not built here (it needs AVX-512 and ATen's cpublas brgemm)");
  TORCH_CHECK(!tiles || q.scalar_type() != at::kFloat, "the tile path takes bfloat16 or float16, got float32");

  std::vector<int64_t> cu_q = read_offsets(cu_seqlens_q, "cu_seqlens_q");
  std::vector<int64_t> cu_k = read_offsets(cu_seqlens_k, "cu_seqlens_k");
  TORCH_CHECK(cu_q.size() == cu_k.size(), "cu_seqlens_q and cu_seqlens_k must have the same length, got ",
              cu_q.size(), " and ", cu_k.size());
  TORCH_CHECK(cu_q.front() >= 0 && cu_q.back() <= q.size(0), "cu_seqlens_q must lie within q's ", q.size(0),
              " rows");
  TORCH_CHECK(cu_k.front() >= 0 && cu_k.back() <= k.size(0) && cu_k.back() <= v.size(0),
              "cu_seqlens_k must lie within the rows of k and v");
  for (size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const int64_t nq = cu_q[b + 1] - cu_q[b], nk = cu_k[b + 1] - cu_k[b];
    TORCH_CHECK(nq >= 0 && nk >= 0, "cu_seqlens must be non-decreasing (sequence ", b, ")");
    TORCH_CHECK(nq <= nk, "sequence ", b, " has ", nq, " queries but only ", nk,
                " keys; queries are the first tokens of their sequence");
  }

  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k, v, out, std::move(cu_q), std::move(cu_k), num_heads, scale, window, tiles);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<BFloat16>(q, k, v, out, std::move(cu_q), std::move(cu_k), num_heads, scale, window, tiles);
  } else {
    run<Half>(q, k, v, out, std::move(cu_q), std::move(cu_k), num_heads, scale, window, tiles);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Linear layers on fp32 GEMMs: y = x W^T + bias, then exact (erf) GELU or + residual, in one pass over y.
// - float32 layers (linear_f32): oneDNN's GEMM applies its GELU post-op to the output after the product; here it is
//   applied to each output tile while it is in L1 (on an AVX2-only AMD EPYC the intermediate GEMM of MiniLM ran at
//   66-68 GFLOP/s against oneDNN's 62-64 with its post-op, both alone on 4,096 rows).
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

#if XENC_GEMM_F32
constexpr int64_t kGemmRows = 96;  // rows of x per block: 96 x 384 fp32 (x widened) stays in L2
constexpr int64_t kGemmCols = 64;  // columns of W^T per block: a 96 x 64 fp32 output tile, 24 KB, stays in L1

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

// The last step of every GEMM here: exact GELU, or + the residual's n lanes at `res` (where there is one).
template <typename T>
XENC_INLINE vf finish(vf v, bool gelu, const T* res, int64_t n) {
  if (gelu) {
    return v * splat(0.5f) * (splat(1.f) + erf_as(v * splat(0.70710678118654752f)));
  }
  return res ? v + load_first(res, n) : v;
}

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
#endif  // XENC_GEMM_F32

// ---------------------------------------------------------------------------------------------------------------
// bf16 linear layers on fp16 FMAs: y = x W^T + bias, then exact (erf) GELU or + residual, rounded once to bf16.
// An AVX512-FP16 FMA does 32 multiply-adds where an fp32 FMA does 16, at the same rate: on Intel cores without AMX
// that is twice the fp32 GEMM's rate and four times the bf16 dot product's. bf16 values are exact in fp16 (8
// significant bits of 11) when they lie in its normal range, which scaling by powers of two ensures: each row of x
// by its own 2^e (its largest element to [64, 128)), W by 2^t (its largest to [1, 2)), undone in fp32 at the end.
// The products and sums run in fp16 over kHalfChunk consecutive k, where no sum can exceed 64 * 128 * 2 = 16384
// (fp16's largest is 65504), and the chunks' sums add up in fp32. Each fp16 step rounds to 11 bits, against the
// 8 bits the bf16 output keeps: on MiniLM-L6 the logits' error against fp32 grew by 5-12% over the fp32 GEMM's
// (measured), well inside the bound the project holds bf16 to. A row's arithmetic depends on that row alone: rows
// are bitwise independent of the other rows and of the thread count.
//
// Register blocking: kHalfRows rows x kHalfVecs 32-column fp16 vectors of accumulators (24 of the 32 zmm
// registers); each x element is stored twice in a 32-bit word, so that one broadcast load (no shuffle) fills all
// 32 lanes. W^T is packed once at load into fp16 blocks [N / kHalfCols][K][kHalfCols], zero-padded.

#if XENC_HALF_GEMM
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
#endif  // XENC_HALF_GEMM

bool gemm_f32_built() { return XENC_GEMM_F32; }
bool half_gemm_built() { return XENC_HALF_GEMM; }
bool paired_bf16_built() { return kPairedKeys<BFloat16>; }

at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t num_heads,
                            double scale, int64_t window) {
  return attention(q, k, v, cu_seqlens_q, cu_seqlens_k, num_heads, scale, window, false);
}

at::Tensor packed_attention_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t num_heads,
                                  double scale, int64_t window) {
  return attention(q, k, v, cu_seqlens_q, cu_seqlens_k, num_heads, scale, window, true);
}

bool tiles_built() { return XENC_TILES; }

// The attention of a layer read at first tokens only, its keys and values folded into the query
// (folded_first_token_attention in layers.py): per pair b, rows cu_seqlens[b]:[b + 1] of x (T, d), and head h,
// sum_j softmax_j(x_j . folded[h, b]) x_j, returned as (B, H, d) (zeros for empty pairs and for pairs past
// cu_seqlens). Two thin products and a softmax per pair, with torch's ops; the pairs are shared among the threads,
// each pair's ops single-threaded wherever it runs, so a pair's result depends on its rows alone.
at::Tensor folded_pool(const at::Tensor& x, const at::Tensor& folded, const at::Tensor& cu_seqlens) {
  TORCH_CHECK(x.dim() == 2 && folded.dim() == 3 && folded.size(2) == x.size(1) &&
                  folded.scalar_type() == x.scalar_type() && x.device().is_cpu() && folded.device().is_cpu(),
              "folded_pool takes x (T, d) and folded (H, B, d) of one dtype on the CPU, got ", x.sizes(), " ",
              x.scalar_type(), " and ", folded.sizes(), " ", folded.scalar_type());
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kInt && cu_seqlens.size(0) >= 1 &&
                  cu_seqlens.size(0) - 1 <= folded.size(1),
              "cu_seqlens must be int32 (P + 1,) with P <= ", folded.size(1), " pairs, got ", cu_seqlens.scalar_type(),
              " ", cu_seqlens.sizes());
  const at::Tensor cu = cu_seqlens.contiguous();
  const int32_t* bounds = cu.const_data_ptr<int32_t>();
  const int64_t pairs = cu.size(0) - 1;
  for (int64_t b = 0; b < pairs; ++b) {
    TORCH_CHECK(0 <= bounds[b] && bounds[b] <= bounds[b + 1] && bounds[b + 1] <= x.size(0),
                "cu_seqlens must rise within the ", x.size(0), " rows of x, got ", bounds[b], " then ", bounds[b + 1]);
  }
  at::Tensor pooled = at::zeros({folded.size(1), folded.size(0), x.size(1)}, x.options());
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the worker threads take the caller's
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode mode(inference);
    c10::ParallelGuard single_threaded(true);
    for (int64_t b = begin; b < end; ++b) {
      if (bounds[b + 1] > bounds[b]) {
        const at::Tensor rows = x.narrow(0, bounds[b], bounds[b + 1] - bounds[b]);
        const at::Tensor weights = at::softmax(at::mm(rows, folded.select(1, b).t()), 0);  // (n, H)
        at::Tensor out = pooled.select(0, b);
        at::mm_out(out, weights.t(), rows);
      }
    }
  });
  return pooled;
}

}  // namespace
}  // namespace xenc_lab

TORCH_LIBRARY(xenc_lab, m) {
  m.def(
      "packed_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int num_heads, "
      "float scale, int window) -> Tensor");
  m.def(
      "packed_attention_tiles(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int num_heads, "
      "float scale, int window) -> Tensor");
  m.def("tiles_built() -> bool", &xenc_lab::tiles_built);
  m.def("folded_pool(Tensor x, Tensor folded, Tensor cu_seqlens) -> Tensor");
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  m.def("gemm_f32_built() -> bool", &xenc_lab::gemm_f32_built);
  m.def("half_gemm_built() -> bool", &xenc_lab::half_gemm_built);
  m.def("paired_bf16_built() -> bool", &xenc_lab::paired_bf16_built);
  m.def(
      "linear_half(Tensor x, Tensor blocks, int weight_exponent, Tensor bias, int out_features, str activation, "
      "Tensor? residual) -> Tensor");
  m.def(
      "linear_widened(Tensor x, Tensor blocks, Tensor bias, int out_features, str activation, Tensor? residual) -> "
      "Tensor");
  m.def(
      "linear_f32(Tensor x, Tensor blocks, Tensor bias, int out_features, str activation, Tensor? residual) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(xenc_lab, CPU, m) {
  m.impl("packed_attention", &xenc_lab::packed_attention);
  m.impl("packed_attention_tiles", &xenc_lab::packed_attention_tiles);
  m.impl("layer_norm", &xenc_lab::layer_norm);
  m.impl("folded_pool", &xenc_lab::folded_pool);
#if XENC_GEMM_F32
  m.impl("linear_f32", &xenc_lab::linear_f32);
  m.impl("linear_widened", &xenc_lab::linear_widened);
#endif
#if XENC_HALF_GEMM
  m.impl("linear_half", &xenc_lab::linear_half);
#endif
}
