// The attention operators' entry points: packed_attention (and its tile path) and paged_attention take torch
// tensors, check them, lay out the problem (attention.h) and hand it to the kernel (attention.cpp) or the tile path
// (attention_tiles.cpp) in the inputs' dtype. No arithmetic of the attention itself is here.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention.h"
#include "checks.h"
#include "ops.h"
#include "vec.h"

namespace xenc_lab {
namespace {

// q's dtype, columns and head split, checked for `op`; returns the head dim.
int64_t check_queries(const at::Tensor& q, int64_t num_heads, const char* op) {
  check_float_dtype(q, op);
  check_stream(q, "q", q, q, "q");
  TORCH_CHECK(num_heads > 0 && q.size(1) % num_heads == 0, "num_heads (", num_heads, ") must divide the ",
              q.size(1), " columns of q");
  const int64_t head_dim = q.size(1) / num_heads;
  TORCH_CHECK(head_dim >= 1 && head_dim <= kMaxHeadDim, "head_dim must be in [1, ", kMaxHeadDim, "], got ",
              head_dim);
  return head_dim;
}

// The problem over q, k and v (and out): strides, sequences, heads and scale; the window as its half width.
template <typename T>
Problem<T> problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, Sequences s,
                   int64_t num_heads, double scale, int64_t window) {
  return Problem<T>{q.const_data_ptr<T>(), k.const_data_ptr<T>(), v.const_data_ptr<T>(), out.mutable_data_ptr<T>(),
                    q.stride(0), k.stride(0), v.stride(0), out.stride(0), std::move(s.q), std::move(s.k), num_heads,
                    q.size(1) / num_heads, static_cast<float>(scale), window < 0 ? -1 : window / 2};
}

// Rows of the output outside every sequence (a filler tail) are zero.
template <typename T>
void zero_outside_sequences(const Problem<T>& p, at::Tensor& out) {
  const int64_t row_bytes = out.size(1) * static_cast<int64_t>(sizeof(T));
  if (out.numel() > 0) {
    std::memset(p.out, 0, p.cu_q.front() * row_bytes);
    std::memset(p.out + p.cu_q.back() * p.out_stride, 0, (out.size(0) - p.cu_q.back()) * row_bytes);
  }
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& cu_seqlens_k, int64_t num_heads, double scale, int64_t window, bool tiles) {
  check_queries(q, num_heads, "packed_attention");
  check_stream(k, "k", q, q, "q");
  check_stream(v, "v", q, q, "q");
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(window >= -1, "window must be >= 0 (or -1 for full attention), got ", window);
  TORCH_CHECK(!tiles || XENC_TILES, "the tile path was not built here (it needs AVX-512 and ATen's cpublas brgemm)");
  TORCH_CHECK(!tiles || q.scalar_type() != at::kFloat, "the tile path takes bfloat16 or float16, got float32");
  Sequences s = read_sequences(cu_seqlens_q, cu_seqlens_k, q.size(0), std::min(k.size(0), v.size(0)),
                               "the rows of k and v", "first");

  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());
  dispatch_float(q, [&](auto tag) {
    using T = decltype(tag);
    const Problem<T> p = problem<T>(q, k, v, out, std::move(s), num_heads, scale, window);
    zero_outside_sequences(p, out);
#if XENC_TILES
    if constexpr (!std::is_same_v<T, float>) {
      if (tiles) {
        run_tiles(p);
        return;
      }
    }
#endif
    run_kernel(p);
  });
  return out;
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& key_index, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& cu_seqlens_k, int64_t num_heads, double scale) {
  const int64_t head_dim = check_queries(q, num_heads, "paged_attention");
  TORCH_CHECK(k.dim() == 2 && k.size(1) % head_dim == 0 && k.size(1) > 0 && num_heads % (k.size(1) / head_dim) == 0,
              "k must be (tokens, key_heads * ", head_dim, ") with key_heads dividing num_heads (", num_heads,
              "), got shape ", k.sizes());
  for (const auto& [x, name] : {std::pair{&k, "k"}, {&v, "v"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    check_stream(*x, name, q, k, "k");
  }
  TORCH_CHECK(v.size(0) == k.size(0) && v_cache.size(0) == k_cache.size(0),
              "k and v (and k_cache and v_cache) must have the same number of rows");
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(key_index.device().is_cpu() && key_index.dim() == 1 && key_index.scalar_type() == at::kLong &&
                  key_index.is_contiguous(),
              "key_index must be a contiguous 1-D int64 CPU tensor");
  Sequences s = read_sequences(cu_seqlens_q, cu_seqlens_k, q.size(0), key_index.numel(),
                               c10::str("key_index's ", key_index.numel(), " entries"), "last");
  const int64_t* index = key_index.const_data_ptr<int64_t>();
  const int64_t rows = k_cache.size(0) + k.size(0);
  for (int64_t i = s.k.front(); i < s.k.back(); ++i) {
    TORCH_CHECK(index[i] >= 0 && index[i] < rows, "key_index[", i, "] = ", index[i], " is not a row of k_cache (",
                k_cache.size(0), ") or of k (", k.size(0), ")");
  }

  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());
  dispatch_float(q, [&](auto tag) {
    using T = decltype(tag);
    Problem<T> p = problem<T>(q, k, v, out, std::move(s), num_heads, scale, -1);
    p.causal = true;
    p.group = num_heads / (k.size(1) / p.head_dim);
    p.key_index = index;
    p.k_cache = k_cache.const_data_ptr<T>();
    p.v_cache = v_cache.const_data_ptr<T>();
    p.cache_rows = k_cache.size(0);
    p.kc_stride = k_cache.stride(0);
    p.vc_stride = v_cache.stride(0);
    zero_outside_sequences(p, out);
    run_kernel(p);
  });
  return out;
}

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

}  // namespace xenc_lab
