// The tile path (bf16, fp16): per block of kTileQueries queries, S = Q K^T and O = P V are batch-reduce GEMMs of
// ATen's cpublas (oneDNN's brgemm ukernel: AMX tiles where the CPU has them, AVX-512 dot products elsewhere), and
// the softmax between them runs as in the kernel, in fp32. P is rounded to the input type before P V (as torch's
// flash attention does on the CPU); the sums that divide O are those of the unrounded fp32 numerators.
// Every GEMM shape depends only on the sequence's own length and the head shape, so a pair's result is bitwise
// independent of its batchmates and of the thread count, as in the kernel.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "vec.h"

#if XENC_TILES
namespace xenc_lab {
namespace {

constexpr int64_t kTileQueries = 32;  // queries per block: two 16-row AMX tiles
constexpr int64_t kTileKeys = 32;     // keys are padded to a multiple: whole tiles of keys, whole VNNI pairs

template <typename T>
class TileWorker {
  static_assert(sizeof(T) == 2, "the tile path takes 16-bit inputs");

 public:
  static constexpr int64_t kBlock = kTileQueries;
  static constexpr bool kGroups = false;  // one head per item (the tile path takes no paged, grouped problems)

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
    const int64_t width = std::min(padded_keys_, round_up(p_.key_end(it.seq, i0 + rows - 1), kTileKeys)) - k_base;

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
      const int64_t lo = p_.key_begin(i0 + r) - k_base, hi = p_.key_end(it.seq, i0 + r) - k_base;
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

}  // namespace

void run_tiles(const Problem<BFloat16>& p) { run_items<TileWorker<BFloat16>>(p); }
void run_tiles(const Problem<Half>& p) { run_items<TileWorker<Half>>(p); }

}  // namespace xenc_lab
#endif  // XENC_TILES
