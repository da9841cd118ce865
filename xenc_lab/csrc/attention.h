// What the attention kernel (attention.cpp) and its tile path (attention_tiles.cpp) share: the problem as raw
// pointers, the work items and their scheduling onto the intra-op threads, and the packing of 16-bit keys and values
// into dword pairs.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace xenc_lab {

// ---------------------------------------------------------------------------------------------------------------
// Problem and work items.

// One call's inputs, as raw pointers and element strides.
constexpr int64_t kMaxHeadDim = 256;  // the widest head the kernel and the tile path take

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
  // Decoders (paged_attention): query i of a sequence of nq queries and nk keys sees keys [0, nk - nq + i], its
  // queries being its last tokens; each key and value head serves `group` consecutive query heads; and key j of
  // sequence b is row s = key_index[cu_k[b] + j] of k_cache and v_cache where s < cache_rows, else row
  // s - cache_rows of k and v (key_index null: row cu_k[b] + j of k and v).
  bool causal = false;
  int64_t group = 1;
  const int64_t* key_index = nullptr;
  const T* k_cache = nullptr;
  const T* v_cache = nullptr;
  int64_t cache_rows = 0, kc_stride = 0, vc_stride = 0;

  int64_t num_seqs() const { return static_cast<int64_t>(cu_q.size()) - 1; }
  int64_t num_queries(int64_t b) const { return cu_q[b + 1] - cu_q[b]; }
  int64_t num_keys(int64_t b) const { return cu_k[b + 1] - cu_k[b]; }
  bool paged() const { return key_index != nullptr; }
  // Visible keys of query i of sequence b: [key_begin, key_end).
  int64_t key_begin(int64_t i) const { return half_window < 0 ? 0 : std::max<int64_t>(0, i - half_window); }
  int64_t key_end(int64_t b, int64_t i) const {
    const int64_t nk = num_keys(b);
    if (causal) {
      return std::min<int64_t>(nk, nk - num_queries(b) + i + 1);
    }
    return half_window < 0 ? nk : std::min<int64_t>(nk, i + half_window + 1);
  }
  // Head h of query position i of sequence b (likewise keys and values, of query head h's key head; output).
  const T* q_at(int64_t b, int64_t i, int64_t h) const { return q + (cu_q[b] + i) * q_stride + h * head_dim; }
  const T* k_at(int64_t b, int64_t j, int64_t h) const { return row(k, k_cache, k_stride, kc_stride, b, j) + kv(h); }
  const T* v_at(int64_t b, int64_t j, int64_t h) const { return row(v, v_cache, v_stride, vc_stride, b, j) + kv(h); }
  T* out_at(int64_t b, int64_t i, int64_t h) const { return out + (cu_q[b] + i) * out_stride + h * head_dim; }

 private:
  int64_t kv(int64_t h) const { return h / group * head_dim; }
  const T* row(const T* stream, const T* cache, int64_t stride, int64_t cache_stride, int64_t b, int64_t j) const {
    if (key_index == nullptr) {
      return stream + (cu_k[b] + j) * stride;
    }
    const int64_t s = key_index[cu_k[b] + j];
    return s < cache_rows ? cache + s * cache_stride : stream + (s - cache_rows) * stride;
  }
};

// Queries [q_begin, q_end) of heads [head, head + heads) of one sequence (several heads: those sharing one key
// head, whose packed keys the worker reuses).
struct Item {
  int64_t seq, head, q_begin, q_end;
  int64_t heads = 1;
};

// bf16 inputs use the bf16 pair dot product (vdpbf16ps) for scores and weighted sums where the CPU has it and the
// build asks for it (XENC_PAIRED_BF16, set where one does the work of two fp32 FMAs); fp32 FMAs on widened keys and
// values everywhere else.
#ifndef XENC_PAIRED_BF16
#define XENC_PAIRED_BF16 0
#endif
template <typename T>
constexpr bool kPairedKeys = std::is_same_v<T, BFloat16> && XENC_BF16_DOT && XENC_PAIRED_BF16;

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
    const int64_t nq = p.num_queries(b);
    const int64_t visible = p.causal ? nk - nq / 2 : p.half_window < 0 ? nk : std::min(nk, 2 * p.half_window + 1);
    return nq * visible + nk;
  };
  std::stable_sort(seqs.begin(), seqs.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });

  // Items take every query head of a key head (W::kGroups: workers that run them so) or one head each.
  const int64_t heads_per_item = W::kGroups ? p.group : 1;
  const int64_t pairs = static_cast<int64_t>(seqs.size()) * (p.num_heads / heads_per_item);
  const int64_t wanted = 8 * num_threads;
  const int64_t splits = pairs >= wanted ? 1 : (wanted + pairs - 1) / pairs;
  std::vector<Item> items;
  for (int64_t b : seqs) {
    const int64_t nq = p.num_queries(b);
    const int64_t block = round_up((nq + splits - 1) / splits, W::kBlock);
    for (int64_t h = 0; h < p.num_heads; h += heads_per_item) {
      for (int64_t i = 0; i < nq; i += block) {
        items.push_back({b, h, i, std::min(nq, i + block), heads_per_item});
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

// The kernel's run_items (attention.cpp): every query row of every sequence of p.out written, nothing else.
void run_kernel(const Problem<float>& p);
void run_kernel(const Problem<BFloat16>& p);
void run_kernel(const Problem<Half>& p);

#if XENC_TILES
// The tile path's run_items (attention_tiles.cpp), for bf16 and fp16 problems.
void run_tiles(const Problem<BFloat16>& p);
void run_tiles(const Problem<Half>& p);
#endif

}  // namespace xenc_lab
