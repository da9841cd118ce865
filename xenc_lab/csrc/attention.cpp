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
//      contiguous fp32 rows (read in place, rows a whole token apart fall into a few L1 sets and evict each other),
//      or, in the paired build, to rows of bf16 key pairs;
//   2. scores of the block's queries against every visible key go to a small buffer, with a running max;
//   3. one pass turns them into exp(s - max) (vectorized exp2) and sums them;
//   4. the probability-weighted sum of value rows accumulates in registers, is divided by the sum and stored.
//      In the paired build the numerators exp(s - max) are rounded to bf16 (their sum is the fp32 one) and the
//      sum runs on the bf16 dot product over pairs of keys, as torch's flash attention does on the CPU in bf16.
// This is an exact (non-online) softmax: no rescaling, the same arithmetic as softmax followed by a matmul. Each
// query's arithmetic is the same whichever block, item or thread computes it, so results are bitwise independent
// of the batch's other sequences and of the thread count.
//
// Decoders call it as paged_attention: the queries are the LAST tokens of their sequence, under a causal mask; each
// key head serves a group of query heads (an item takes the whole group, whose keys are packed once); and the keys
// and values are read through a list of rows, each in the KV cache or in the stream (staged to consecutive rows for
// packing).
//
// In bf16 and fp16 there is a second path, the tile path (attention_tiles.cpp): the two products as oneDNN GEMMs
// (AMX tiles where the CPU has them), the same softmax between them. Which one runs is the caller's choice. The
// operators that take torch tensors, check them and call in here (run_kernel) are ops_attention.cpp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention.h"
#include "vec.h"

namespace xenc_lab {
namespace {


#if XENC_AVX512
// Register blocking: kRows queries x kKeyVecs 16-key vectors of scores, kRows x kColVecs 16-column vectors of
// outputs (24 of the 32 zmm registers).
constexpr int kRows = 6;
constexpr int kKeyVecs = 4;
constexpr int kColVecs = 4;
#else
// Blocking sized for 16 registers of 256 bits (AVX2) or 32 of 128 bits (NEON): 4 x 16 lanes of accumulators.
constexpr int kRows = 4;
constexpr int kKeyVecs = 1;
constexpr int kColVecs = 1;
#endif

// ---------------------------------------------------------------------------------------------------------------
// The kernel.

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
  static constexpr bool kGroups = true;     // an item may take every query head of one key head

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
        staging_(p.paged() ? max_keys * p.head_dim * static_cast<int64_t>(sizeof(T)) : 0),
        scale_log2e_(static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634)) {}

  // Runs `it`, one head after another; `next` (if any) is the item this thread runs after it, whose rows are
  // prefetched meanwhile.
  void run(const Item& it, const Item* next) {
    for (int64_t h = it.head; h < it.head + it.heads; ++h) {
      const Item one{it.seq, h, it.q_begin, it.q_end};
      const Item then{it.seq, h + 1, it.q_begin, it.q_end};
      run_head(one, h + 1 < it.head + it.heads ? &then : next);
    }
  }

 private:
  void run_head(const Item& it, const Item* next) {
    if (it.seq != packed_seq_ || it.head / p_.group != packed_head_ / p_.group) {
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
          num_keys_(next && (next->seq != current.seq || next->head / w.p_.group != current.head / w.p_.group)
                        ? w.p_.num_keys(next->seq)
                        : 0),
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
    int64_t k_stride = p_.k_stride;
    const T* k = p_.paged() ? staged(seq, head, nk, true, &k_stride) : p_.k_at(seq, 0, head);
    if constexpr (kPairedKeys<T>) {
#if XENC_BF16_DOT
      pack_keys_bf16_pairs(k, k_stride, nk, dh_, keys_.as<uint32_t>());
      int64_t v_stride = p_.v_stride;
      const T* v = p_.paged() ? staged(seq, head, nk, false, &v_stride) : p_.v_at(seq, 0, head);
      pack_value_pairs(v, v_stride, nk, nk, dh_, dh16_, values_.as<uint32_t>());
#endif
    } else {
      pack_keys_f32(k, k_stride, nk, dh_, keys_.as<float>());
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

  // Paged keys (or values) of (seq, head) copied to consecutive rows of dh elements (*stride), for the packing
  // routines that read rows a stride apart.
  const T* staged(int64_t seq, int64_t head, int64_t nk, bool keys, int64_t* stride) {
    T* dst = staging_.as<T>();
    for (int64_t j = 0; j < nk; ++j) {
      std::memcpy(dst + j * dh_, keys ? p_.k_at(seq, j, head) : p_.v_at(seq, j, head), dh_ * sizeof(T));
    }
    *stride = dh_;
    return dst;
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
    int64_t lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = p_.key_begin(i0 + r);
      hi[r] = p_.key_end(it.seq, i0 + r);
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
  Scratch keys_, values_, scores_, queries_, probs_, staging_;
  const float scale_log2e_;
  int64_t packed_seq_ = -1, packed_head_ = -1;
};

}  // namespace

void run_kernel(const Problem<float>& p) { run_items<Worker<float>>(p); }
void run_kernel(const Problem<BFloat16>& p) { run_items<Worker<BFloat16>>(p); }
void run_kernel(const Problem<Half>& p) { run_items<Worker<Half>>(p); }

}  // namespace xenc_lab
